//! Named operators: admin tokens created and deleted through consensus. Only the argon2id hash
//! of a token is kept (see ARCHITECTURE "Operators and roles"). `root` is configuration and
//! never appears here.

use modelforge_proto::api::Role;
use serde::Deserialize;
use serde::Serialize;

use super::Outcome;
use super::Refusal;
use super::RefusalCode;
use super::State;

/// The most named tokens the state keeps.
pub const OPERATORS_MAX: usize = 1000;

/// Names no token may take: `root` is the bootstrap token, `system` the actor of the members'
/// own commands.
pub const RESERVED_NAMES: [&str; 2] = ["root", "system"];

/// A named operator's token.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct OperatorToken {
    pub name: String,
    pub role: Role,
    /// The public id inside the token (`mfat_<id>_...`): how a presented token finds its row.
    pub token_id: String,
    /// The argon2id hash (PHC string) of the whole token string.
    pub hash: String,
    pub created_at_ms: i64,
    /// The actor that created it.
    pub created_by: String,
}

/// Whether `name` may name a token.
pub fn valid_name(name: &str) -> bool {
    modelforge_proto::ids::is_tame(name) && !RESERVED_NAMES.contains(&name)
}

impl State {
    pub(super) fn create_operator(
        &mut self,
        now: i64,
        actor: &str,
        name: &str,
        role: Role,
        token_id: &str,
        hash: &str,
    ) -> Result<Outcome, Refusal> {
        if !valid_name(name) {
            return Err(Refusal::new(RefusalCode::InvalidOperatorName));
        }
        if self.operators.contains_key(name) {
            return Err(Refusal::new(RefusalCode::OperatorExists));
        }
        if self.operators.len() >= OPERATORS_MAX {
            return Err(Refusal::new(RefusalCode::TooManyOperators));
        }
        if self.operators.values().any(|o| o.token_id == token_id) {
            return Err(Refusal::with(
                RefusalCode::OperatorExists,
                "token id collision; retry",
            ));
        }
        self.operators.insert(
            name.to_string(),
            OperatorToken {
                name: name.to_string(),
                role,
                token_id: token_id.to_string(),
                hash: hash.to_string(),
                created_at_ms: now,
                created_by: actor.to_string(),
            },
        );
        Ok(Outcome::OperatorCreated {
            name: name.to_string(),
            created_at_ms: now,
        })
    }

    pub(super) fn delete_operator(&mut self, name: &str) -> Result<Outcome, Refusal> {
        if name == "root" {
            return Err(Refusal::new(RefusalCode::RootTokenFixed));
        }
        match self.operators.remove(name) {
            Some(_) => Ok(Outcome::OperatorDeleted {
                name: name.to_string(),
            }),
            None => Err(Refusal::new(RefusalCode::OperatorNotFound)),
        }
    }

    /// The operator whose token has public id `token_id`.
    pub fn operator_by_token_id(&self, token_id: &str) -> Option<&OperatorToken> {
        self.operators.values().find(|o| o.token_id == token_id)
    }

    /// Names are keys; token ids are unique; every name is valid.
    pub(super) fn check_operators(&self) -> Result<(), String> {
        let mut ids = std::collections::BTreeSet::new();
        for (name, o) in &self.operators {
            if name != &o.name || !valid_name(name) {
                return Err(format!("operator {name:?} is filed under another name"));
            }
            if !ids.insert(&o.token_id) {
                return Err(format!("operator token id {} is held twice", o.token_id));
            }
        }
        if self.operators.len() > OPERATORS_MAX {
            return Err(format!("{} operators kept", self.operators.len()));
        }
        Ok(())
    }
}
