//! Resolving the services' `--device`/`--dtype` flags against what libtorch
//! sees, and the one device label every role reports (`cpu`, `cuda:N`).

use dflash_shell::{DeviceChoice, DtypeChoice};
use tch::{Device, Kind};

/// A device flag that names a device this process does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--device {requested} requested, but libtorch sees {available} CUDA device(s){hint}")]
pub struct DeviceError {
    pub requested: DeviceChoice,
    pub available: usize,
    hint: &'static str,
}

/// CUDA devices libtorch can use (0 in a CPU-only build).
pub fn cuda_device_count() -> usize {
    if tch::Cuda::is_available() {
        usize::try_from(tch::Cuda::device_count()).unwrap_or(0)
    } else {
        0
    }
}

/// `auto` → the first CUDA device if there is one, else the CPU; `cuda:N`
/// → that device, or an error at once (not a crash at the first kernel)
/// when libtorch does not see it.
pub fn resolve_device(choice: DeviceChoice) -> Result<Device, DeviceError> {
    resolve_device_among(choice, cuda_device_count())
}

/// [`resolve_device`] for a given CUDA device count (testable anywhere).
pub fn resolve_device_among(choice: DeviceChoice, available: usize) -> Result<Device, DeviceError> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto if available > 0 => Ok(Device::Cuda(0)),
        DeviceChoice::Auto => Ok(Device::Cpu),
        DeviceChoice::Cuda(index) if index < available => Ok(Device::Cuda(index)),
        DeviceChoice::Cuda(_) => Err(DeviceError {
            requested: choice,
            available,
            hint: if available == 0 {
                " (a CPU-only libtorch build, or no GPU visible: check CUDA_VISIBLE_DEVICES and the NVIDIA runtime)"
            } else {
                ""
            },
        }),
    }
}

/// `cpu` or `cuda:N`: how every role names its device in status and logs.
pub fn device_label(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(index) => format!("cuda:{index}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// The libtorch kind of a dtype flag.
pub fn kind_of(dtype: DtypeChoice) -> Kind {
    match dtype {
        DtypeChoice::Bf16 => Kind::BFloat16,
        DtypeChoice::F16 => Kind::Half,
        DtypeChoice::F32 => Kind::Float,
    }
}

/// The dtype flag, or the one default policy when it is not given.
pub fn kind_for(dtype: Option<DtypeChoice>, device: Device) -> Kind {
    kind_of(dtype.unwrap_or_else(|| DtypeChoice::default_for(device == Device::Cpu)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_resolve_against_the_devices_seen() {
        assert_eq!(resolve_device_among(DeviceChoice::Auto, 0), Ok(Device::Cpu));
        assert_eq!(
            resolve_device_among(DeviceChoice::Auto, 2),
            Ok(Device::Cuda(0))
        );
        assert_eq!(
            resolve_device_among(DeviceChoice::Cuda(1), 2),
            Ok(Device::Cuda(1))
        );
        assert_eq!(resolve_device_among(DeviceChoice::Cpu, 2), Ok(Device::Cpu));
        let missing = resolve_device_among(DeviceChoice::Cuda(0), 0).unwrap_err();
        assert!(
            missing
                .to_string()
                .starts_with("--device cuda:0 requested, but libtorch sees 0 CUDA device(s)"),
            "{missing}"
        );
        let beyond = resolve_device_among(DeviceChoice::Cuda(2), 2).unwrap_err();
        assert_eq!(
            beyond.to_string(),
            "--device cuda:2 requested, but libtorch sees 2 CUDA device(s)"
        );
    }

    #[test]
    fn this_cpu_build_resolves_auto_to_the_cpu() {
        if cuda_device_count() == 0 {
            assert_eq!(resolve_device(DeviceChoice::Auto), Ok(Device::Cpu));
            assert!(resolve_device(DeviceChoice::Cuda(0)).is_err());
        }
    }

    #[test]
    fn labels_and_kinds() {
        assert_eq!(device_label(Device::Cpu), "cpu");
        assert_eq!(device_label(Device::Cuda(3)), "cuda:3");
        assert_eq!(kind_for(None, Device::Cpu), Kind::Float);
        assert_eq!(kind_for(None, Device::Cuda(0)), Kind::BFloat16);
        assert_eq!(kind_for(Some(DtypeChoice::F16), Device::Cpu), Kind::Half);
    }
}
