//! Media names as engines spell them, to one canonical name per medium.

/// Aliases of the standard media (upper case). vLLM's offloading connector publishes
/// its tiers as `"CPU"` and `"STORAGE"` (a file system or object store behind the CPU
/// tier): storage is the disk tier, priced as a read, not host memory.
const ALIASES: [(&str, &str); 13] = [
    ("GPU", "GPU"),
    ("NPU", "GPU"),
    ("HBM", "GPU"),
    ("DEVICE", "GPU"),
    ("CPU", "CPU"),
    ("CPU_PINNED", "CPU"),
    ("DRAM", "CPU"),
    ("HOST", "CPU"),
    ("DISK", "DISK"),
    ("SSD", "DISK"),
    ("NVME", "DISK"),
    ("FILE", "DISK"),
    ("STORAGE", "DISK"),
];

/// The upper-case medium name (vLLM's `"GPU"`/`"CPU"`, Mooncake's gpu/cpu/disk, SGLang's
/// CPU_PINNED...). `None` is the engine's own device cache (vLLM leaves it unset for GPU
/// blocks). Unknown names are kept, upper-cased, as media of their own.
pub fn canonical_medium(medium: Option<&str>) -> String {
    let Some(m) = medium else {
        return "GPU".to_string();
    };
    let upper = m.to_uppercase();
    match ALIASES.iter().find(|(alias, _)| *alias == upper) {
        Some((_, name)) => (*name).to_string(),
        None => upper,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_and_unknown_names() {
        let got: Vec<String> = [
            None,
            Some("GPU"),
            Some("gpu"),
            Some("cpu"),
            Some("CPU_PINNED"),
            Some("disk"),
            Some("SSD"),
            Some("external"),
            Some("STORAGE"),
            Some("storage"),
        ]
        .into_iter()
        .map(canonical_medium)
        .collect();
        assert_eq!(got, ["GPU", "GPU", "GPU", "CPU", "CPU", "DISK", "DISK", "EXTERNAL", "DISK", "DISK"]);
    }
}
