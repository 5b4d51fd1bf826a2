//! Which c10d backend moves a tensor: Gloo on CPUs, NCCL on CUDA devices.

/// Which c10d backend moves a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// ProcessGroupGloo: CPU tensors, TCP.
    #[default]
    Gloo,
    /// ProcessGroupNCCL: CUDA tensors; only in builds with the `nccl` feature.
    Nccl,
}

/// The backend for tensors on `device`: NCCL for CUDA tensors when this
/// build has the `nccl` feature, Gloo otherwise.
pub fn backend_for(device: tch::Device) -> Backend {
    match device {
        tch::Device::Cuda(_) if cfg!(feature = "nccl") => Backend::Nccl,
        _ => Backend::Gloo,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_tensors_use_gloo() {
        assert_eq!(backend_for(tch::Device::Cpu), Backend::Gloo);
    }

    #[test]
    fn cuda_tensors_use_nccl_only_with_the_feature() {
        let expected = if cfg!(feature = "nccl") {
            Backend::Nccl
        } else {
            Backend::Gloo
        };
        assert_eq!(backend_for(tch::Device::Cuda(0)), expected);
    }
}
