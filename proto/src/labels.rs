//! GPU attributes named as NVIDIA GPU Feature Discovery's node labels, and placement
//! constraints on them (`POST /api/v1/allocations` `"constraints"`).
//!
//! GFD labels a node; a node here may hold GPUs of several kinds, so the per-GPU labels
//! (product, memory, family, compute capability) are matched against each GPU and the
//! node-wide ones (count, MIG strategy) against the node.

use std::collections::BTreeMap;

use crate::wire::Accelerator;

pub const PRODUCT: &str = "nvidia.com/gpu.product";
pub const MEMORY: &str = "nvidia.com/gpu.memory";
pub const FAMILY: &str = "nvidia.com/gpu.family";
pub const COMPUTE_MAJOR: &str = "nvidia.com/gpu.compute.major";
pub const COMPUTE_MINOR: &str = "nvidia.com/gpu.compute.minor";
pub const COUNT: &str = "nvidia.com/gpu.count";
pub const MIG_STRATEGY: &str = "nvidia.com/mig.strategy";

/// Every label a constraint may name.
pub const KNOWN: &[&str] = &[
    PRODUCT,
    MEMORY,
    FAMILY,
    COMPUTE_MAJOR,
    COMPUTE_MINOR,
    COUNT,
    MIG_STRATEGY,
];

/// GFD's architecture family for a compute capability.
pub fn family(major: u32, minor: u32) -> &'static str {
    match (major, minor) {
        (1, _) => "tesla",
        (2, _) => "fermi",
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, 5..) => "turing",
        (7, _) => "volta",
        (8, 9..) => "ada-lovelace",
        (8, _) => "ampere",
        (9, _) => "hopper",
        (10.., _) => "blackwell",
        _ => "undefined",
    }
}

/// The labels of one GPU (those it can say: a field it lacks gives no label).
pub fn gpu_labels(a: &Accelerator) -> BTreeMap<&'static str, String> {
    let mut out = BTreeMap::new();
    // GFD replaces spaces with dashes: "NVIDIA H200" -> "NVIDIA-H200".
    out.insert(PRODUCT, a.name.trim().replace(' ', "-"));
    if let Some(m) = a.memory_total_mib {
        out.insert(MEMORY, m.to_string());
    }
    if let Some((major, minor)) = a
        .compute_capability
        .as_deref()
        .and_then(|c| c.split_once('.'))
        .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)))
    {
        out.insert(COMPUTE_MAJOR, major.to_string());
        out.insert(COMPUTE_MINOR, minor.to_string());
        out.insert(FAMILY, family(major, minor).to_string());
    }
    out
}

/// The node's labels: its first GPU's, the count, and the MIG strategy (`none` without MIG,
/// `mixed` when any GPU has MIG enabled).
pub fn node_labels(gpus: &[Accelerator]) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = gpus
        .first()
        .map(gpu_labels)
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    out.insert(COUNT.into(), gpus.len().to_string());
    out.insert(MIG_STRATEGY.into(), mig_strategy(gpus).into());
    out
}

fn mig_strategy(gpus: &[Accelerator]) -> &'static str {
    if gpus
        .iter()
        .any(|a| a.mig_mode.as_deref() == Some("enabled"))
    {
        "mixed"
    } else {
        "none"
    }
}

/// Whether GPU `a` of a node with `gpus` meets every constraint (label -> exact value).
pub fn meets(
    constraints: &BTreeMap<String, String>,
    a: &Accelerator,
    gpus: &[Accelerator],
) -> bool {
    if constraints.is_empty() {
        return true;
    }
    // Called for every GPU of every candidate node: the node-wide labels are compared
    // directly, not built into a map each time.
    let own = gpu_labels(a);
    constraints.iter().all(|(k, want)| match k.as_str() {
        COUNT => gpus.len().to_string() == *want,
        MIG_STRATEGY => mig_strategy(gpus) == want,
        _ => own.get(k.as_str()) == Some(want),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(name: &str, cc: Option<&str>, mig: &str) -> Accelerator {
        Accelerator {
            uuid: "GPU-1".into(),
            name: name.into(),
            memory_total_mib: Some(143_771),
            pci_bus_id: None,
            index: Some(0),
            mig_mode: Some(mig.into()),
            power_limit_w: None,
            compute_capability: cc.map(Into::into),
        }
    }

    #[test]
    fn labels_are_named_and_valued_as_gfd_does() {
        let h200 = gpu("NVIDIA H200", Some("9.0"), "disabled");
        let l = node_labels(&[h200.clone(), h200.clone()]);
        assert_eq!(l[PRODUCT], "NVIDIA-H200");
        assert_eq!(l[MEMORY], "143771");
        assert_eq!(l[FAMILY], "hopper");
        assert_eq!(
            (l[COMPUTE_MAJOR].as_str(), l[COMPUTE_MINOR].as_str()),
            ("9", "0")
        );
        assert_eq!(l[COUNT], "2");
        assert_eq!(l[MIG_STRATEGY], "none");
        assert_eq!(family(8, 0), "ampere");
        assert_eq!(family(8, 9), "ada-lovelace");
        assert_eq!(family(7, 5), "turing");
        assert_eq!(family(10, 0), "blackwell");
        // No compute capability (an older agent): no family or compute labels.
        let old = gpu("NVIDIA A100-SXM4-80GB", None, "enabled");
        let l = node_labels(&[old]);
        assert!(!l.contains_key(FAMILY) && !l.contains_key(COMPUTE_MAJOR));
        assert_eq!(l[MIG_STRATEGY], "mixed");
    }

    #[test]
    fn constraints_match_each_gpu_and_the_node() {
        let h200 = gpu("NVIDIA H200", Some("9.0"), "disabled");
        let a100 = gpu("NVIDIA A100", Some("8.0"), "disabled");
        let node = [h200.clone(), a100.clone()];
        let c = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        let want = c(&[(PRODUCT, "NVIDIA-H200")]);
        assert!(meets(&want, &h200, &node));
        assert!(!meets(&want, &a100, &node));
        assert!(meets(&c(&[(FAMILY, "ampere"), (COUNT, "2")]), &a100, &node));
        assert!(!meets(&c(&[(COUNT, "8")]), &a100, &node));
        assert!(meets(&BTreeMap::new(), &a100, &node));
    }
}
