//! Device and dtype flags, the same for every service: `--device auto`
//! (default: the first CUDA device when libtorch sees one, else the CPU),
//! `cpu`, `cuda` or `cuda:N`; `--dtype bf16|f16|f32`. Parsing only:
//! `dflash_model::device` resolves a choice against the devices libtorch
//! sees and fails at once, with the count it sees, when one is missing.

use std::fmt;
use std::str::FromStr;

/// Which device a model runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The first CUDA device if libtorch sees one, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|index| index.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("unknown device {other:?} (auto, cpu, cuda, cuda:N)")),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Auto => formatter.write_str("auto"),
            DeviceChoice::Cpu => formatter.write_str("cpu"),
            DeviceChoice::Cuda(index) => write!(formatter, "cuda:{index}"),
        }
    }
}

/// Model weight and activation dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeChoice {
    #[value(alias = "bfloat16")]
    Bf16,
    #[value(alias = "float16")]
    F16,
    #[value(alias = "float32")]
    F32,
}

impl DtypeChoice {
    /// The default policy of every service: bf16 on a GPU (what the models
    /// are trained and served in), f32 on the CPU (where bf16 matmuls are
    /// slow and exactness against references matters more).
    pub fn default_for(on_cpu: bool) -> DtypeChoice {
        if on_cpu {
            DtypeChoice::F32
        } else {
            DtypeChoice::Bf16
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_back() {
        for (text, choice) in [
            ("auto", DeviceChoice::Auto),
            ("cpu", DeviceChoice::Cpu),
            ("cuda:3", DeviceChoice::Cuda(3)),
        ] {
            assert_eq!(text.parse::<DeviceChoice>(), Ok(choice));
            assert_eq!(choice.to_string(), text);
        }
        assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(0)));
        let error = "tpu:0".parse::<DeviceChoice>().unwrap_err();
        assert!(
            error.contains("\"tpu:0\"") && error.contains("cuda:N"),
            "{error}"
        );
        assert!("cuda:x".parse::<DeviceChoice>().is_err());
        assert_eq!(DeviceChoice::default(), DeviceChoice::Auto);
    }

    #[test]
    fn dtype_defaults_follow_the_device() {
        assert_eq!(DtypeChoice::default_for(true), DtypeChoice::F32);
        assert_eq!(DtypeChoice::default_for(false), DtypeChoice::Bf16);
    }
}
