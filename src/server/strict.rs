//! Deserialising a request body from a parsed JSON value the way the API document reads it:
//! serde takes a struct from a JSON array of its fields (`[]`, `[[null, null]]`), which the
//! document does not allow. [`from_value`] refuses exactly that and nothing else: unknown fields,
//! whatever they hold, are still ignored (the contract says so).

use serde::Deserializer;
use serde::de::DeserializeOwned;
use serde::de::Error as _;
use serde::de::IntoDeserializer;
use serde::de::Unexpected;
use serde::de::Visitor;
use serde::de::value::MapDeserializer;
use serde::de::value::SeqDeserializer;
use serde_json::Error;
use serde_json::Value;

/// `T` from `value`, refusing a struct (at any depth) given as an array.
pub fn from_value<T: DeserializeOwned>(value: Value) -> Result<T, Error> {
    T::deserialize(Strict(value))
}

struct Strict(Value);

impl<'de> IntoDeserializer<'de, Error> for Strict {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

fn visit_seq<'de, V: Visitor<'de>>(items: Vec<Value>, visitor: V) -> Result<V::Value, Error> {
    let mut seq = SeqDeserializer::new(items.into_iter().map(Strict));
    let out = visitor.visit_seq(&mut seq)?;
    seq.end()?;
    Ok(out)
}

fn visit_map<'de, V: Visitor<'de>>(
    entries: serde_json::Map<String, Value>,
    visitor: V,
) -> Result<V::Value, Error> {
    let mut map = MapDeserializer::new(entries.into_iter().map(|(k, v)| (k, Strict(v))));
    let out = visitor.visit_map(&mut map)?;
    map.end()?;
    Ok(out)
}

/// Methods whose meaning does not depend on nested values go to `Value`'s own deserializer.
macro_rules! to_value {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.0.$method(visitor)
        }
    )*};
}

impl<'de> Deserializer<'de> for Strict {
    type Error = Error;

    to_value! {
        deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
        deserialize_i128 deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
        deserialize_u128 deserialize_f32 deserialize_f64 deserialize_char deserialize_str
        deserialize_string deserialize_bytes deserialize_byte_buf deserialize_unit
        deserialize_identifier
    }

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.0 {
            Value::Array(items) => visit_seq(items, visitor),
            Value::Object(entries) => visit_map(entries, visitor),
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.0.deserialize_unit_struct(name, visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.0 {
            Value::Array(items) => visit_seq(items, visitor),
            other => other.deserialize_seq(visitor),
        }
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.0 {
            Value::Object(entries) => visit_map(entries, visitor),
            other => other.deserialize_map(visitor),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match self.0 {
            Value::Object(entries) => visit_map(entries, visitor),
            Value::Array(_) => Err(Error::invalid_type(Unexpected::Seq, &visitor)),
            other => other.deserialize_any(visitor),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.0.deserialize_enum(name, variants, visitor)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }
}

#[cfg(test)]
mod tests {
    use super::from_value;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Inner {
        #[serde(default)]
        a: Option<u32>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    struct Outer {
        #[serde(default)]
        inner: Option<Inner>,
        #[serde(default)]
        list: Vec<Inner>,
        #[serde(default)]
        names: Vec<String>,
    }

    fn parse(json: &str) -> Result<Outer, serde_json::Error> {
        from_value(serde_json::from_str(json).unwrap())
    }

    #[test]
    fn structs_must_be_objects_and_unknown_fields_stay_ignored() {
        let ok = parse(r#"{"inner": {"a": 1}, "list": [{}], "names": ["x"], "mig": ["1g", [2]]}"#);
        assert_eq!(
            ok.unwrap(),
            Outer {
                inner: Some(Inner { a: Some(1) }),
                list: vec![Inner { a: None }],
                names: vec!["x".into()],
            }
        );
        for bad in [
            "[]",
            "[null, [], []]",
            r#"{"inner": [1]}"#,
            r#"{"list": [[1]]}"#,
            r#"{"list": [{}, []]}"#,
            r#"{"names": "x"}"#,
            "null",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
