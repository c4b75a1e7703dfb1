//! Request and response bodies of the contract's agent API, and the shapes agents, fixture
//! files and outside tools share (inventory, telemetry). A member ignores fields it does not
//! know (serde's default), so agents and members can be upgraded at different times.

use serde::Deserialize;
use serde::Serialize;

use crate::identity::IdentityProof;
use crate::ids::CredentialId;
use crate::ids::NodeId;
use crate::ids::SmokeId;
use crate::intern::Shared;

/// One accelerator as inventoried (NVML, simulated or fixture: the same shape).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, Hash, utoipa::ToSchema)]
pub struct Accelerator {
    pub uuid: String,
    #[schema(value_type = String)]
    pub name: Shared,
    #[serde(default)]
    pub memory_total_mib: Option<u64>,
    #[serde(default)]
    pub pci_bus_id: Option<String>,
    #[serde(default)]
    pub index: Option<u32>,
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub mig_mode: Option<Shared>,
    #[serde(default)]
    pub power_limit_w: Option<u64>,
    /// CUDA compute capability, `major.minor` (`9.0`); absent from older agents. (Never
    /// skipped when absent: the replicated state's encoding is positional.)
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub compute_capability: Option<Shared>,
}

/// A storage root of the node.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, Hash, utoipa::ToSchema)]
pub struct StorageRoot {
    pub path: String,
    #[serde(default)]
    pub capacity_bytes: u64,
    #[serde(default)]
    pub free_bytes: u64,
}

/// What hardware a node has. `accelerators` and `storage_roots` are required.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, Hash, Default, utoipa::ToSchema)]
pub struct Inventory {
    pub accelerators: Vec<Accelerator>,
    pub storage_roots: Vec<StorageRoot>,
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub driver_version: Option<Shared>,
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub cuda_version: Option<Shared>,
    /// `ok`, `absent` or `error: <reason>`.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub nvml: Option<Shared>,
}

/// Per-accelerator telemetry in a heartbeat; every field optional.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default, utoipa::ToSchema)]
pub struct AcceleratorTelemetry {
    #[serde(default)]
    pub uuid: Option<String>,
    #[serde(default)]
    pub utilization_pct: Option<f64>,
    #[serde(default)]
    pub memory_used_mib: Option<f64>,
    #[serde(default)]
    pub temperature_c: Option<f64>,
    #[serde(default)]
    pub power_draw_w: Option<f64>,
    #[serde(default)]
    pub ecc_errors_uncorrected: Option<u64>,
    #[serde(default)]
    pub processes: Vec<ProcessTelemetry>,
    /// Health events seen on this GPU since the agent started, counted (`gpu_health`), each
    /// `{kind, code?, count, first_at, last_at}`. An event this member cannot read (a field
    /// missing or of another type) is dropped, never the heartbeat that carries it; so the
    /// document promises only objects.
    #[serde(default, deserialize_with = "crate::gpu_health::readable_events")]
    #[schema(value_type = Vec<Object>)]
    pub events: Vec<crate::gpu_health::GpuEvent>,
}

/// A compute process running on an accelerator.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default, utoipa::ToSchema)]
pub struct ProcessTelemetry {
    pub pid: u32,
    #[serde(default)]
    pub used_memory_mib: Option<f64>,
}

/// The heartbeat body. `{}` is a valid heartbeat.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default, utoipa::ToSchema)]
pub struct Telemetry {
    #[serde(default)]
    pub accelerators: Vec<AcceleratorTelemetry>,
}

/// `POST /api/v1/agent/enroll`.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EnrollRequest {
    pub token: String,
    #[schema(
        pattern = r"^[A-Za-z0-9_-]{1,63}(\.[A-Za-z0-9_-]{1,63})*$",
        max_length = 253
    )]
    pub hostname: String,
    pub identity: IdentityProof,
    pub inventory: Inventory,
}

/// 201 answer to an enrolment.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EnrollResponse {
    pub node_id: NodeId,
    pub credential: String,
    pub credential_id: CredentialId,
    /// Whether the identity was already known (same node id as before).
    pub reenrolled: bool,
}

/// 200 answer to a heartbeat.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HeartbeatResponse {
    pub status: String,
    pub node_id: NodeId,
    pub server_time: String,
    /// Work for the agent (older agents ignore it; older members send none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub jobs: Vec<Job>,
}

/// A job handed to the agent with a heartbeat answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Job {
    /// Run the capability smoke and report it to
    /// `POST /api/v1/agent/nodes/{node_id}/smoke/{smoke_id}`.
    Smoke {
        smoke_id: SmokeId,
        /// The accelerators the control plane has in the node's inventory.
        expected_uuids: Vec<String>,
    },
}

/// One check of a capability smoke.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct SmokeCheckReport {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// The agent's smoke report.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct SmokeReport {
    pub checks: Vec<SmokeCheckReport>,
}

/// The contract's error body: `{"error": {"code", "message"}}`.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    #[schema(value_type = crate::api::ErrorCode)]
    pub code: String,
    pub message: String,
    /// The request's id (`X-Request-Id`), to find it in the members' logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}
