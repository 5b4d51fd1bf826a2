//! DFlash2's grouped dynamic causal convolution (`GroupedDynamicCausalConv`
//! of `dflash` 0.1.0): around a sublayer, the normed input is convolved
//! before the sublayer and the sublayer's output after it, each with
//! `base_kernel[side] + dynamic kernel`, where both dynamic kernels are
//! projected from the normed input. Per output position `t`, group `g`:
//! `y[t] = Σ_tap (base[tap] + dynamic[t, tap, g]) ⊙ x[t − tap]`, with
//! `x` zero before the block's start: the convolution never crosses from
//! one block into the next (speculators' training applies it per block,
//! and the reference's inference sees one block at a time).

use tch::Tensor;

use super::network::DraftModel;
use super::parameters::DynamicConvolution;

impl DraftModel {
    /// The sublayer's convolved input and the dynamic kernel its output
    /// will be convolved with (`prepare` of the reference). `normed` is
    /// `[batch, blocks·block_length, hidden]`.
    pub(super) fn convolve_sublayer_input(
        &self,
        convolution: &DynamicConvolution,
        normed: &Tensor,
        block_length: i64,
    ) -> (Tensor, Tensor) {
        let (taps, groups) = self.convolution_shape();
        let size = normed.size();
        let dynamic = normed
            .linear::<Tensor>(&self.weight(&convolution.kernel_projection), None)
            .view([size[0], size[1], 2, taps, groups]);
        let base_kernel = self.weight(&convolution.base_kernel);
        let convolved = self.grouped_dynamic_causal_convolution(
            normed,
            &dynamic.select(2, 0),
            &base_kernel.get(0),
            block_length,
        );
        (convolved, dynamic.select(2, 1))
    }

    /// The sublayer's output convolved with the kernel from
    /// [`Self::convolve_sublayer_input`] (`finish` of the reference).
    pub(super) fn convolve_sublayer_output(
        &self,
        convolution: &DynamicConvolution,
        output: &Tensor,
        dynamic: &Tensor,
        block_length: i64,
    ) -> Tensor {
        let base_kernel = self.weight(&convolution.base_kernel);
        self.grouped_dynamic_causal_convolution(output, dynamic, &base_kernel.get(1), block_length)
    }

    /// Taps and channel groups of the convolutions (DFlash2 models only).
    fn convolution_shape(&self) -> (i64, i64) {
        let dflash2 = self.config.dflash2.clone().unwrap_or_default();
        (
            dflash2.conv_kernel_size,
            dflash2.conv_groups(self.config.hidden_size),
        )
    }

    /// `hidden` `[batch, queries, hidden]` convolved within each block of
    /// `block_length` queries; `dynamic` `[batch, queries, taps, groups]`,
    /// `base` `[taps, hidden]`. The same operations in the same order as
    /// the reference (`out + base ⊙ x`, then `addcmul(out, dynamic, x)`),
    /// so f32 results agree to rounding.
    fn grouped_dynamic_causal_convolution(
        &self,
        hidden: &Tensor,
        dynamic: &Tensor,
        base: &Tensor,
        block_length: i64,
    ) -> Tensor {
        let (taps, groups) = self.convolution_shape();
        let size = hidden.size();
        let (batch, queries, hidden_size) = (size[0], size[1], size[2]);
        let blocks = queries / block_length;
        let group_size = hidden_size / groups;
        let values = hidden.reshape([batch, blocks, block_length, groups, group_size]);
        let dynamic = dynamic.reshape([batch, blocks, block_length, taps, groups, 1]);
        let mut output = values.zeros_like();
        for tap in 0..taps.min(block_length) {
            let shifted = if tap == 0 {
                values.shallow_clone()
            } else {
                values
                    .narrow(2, 0, block_length - tap)
                    .constant_pad_nd([0, 0, 0, 0, tap, 0])
            };
            let kernel = base.get(tap).view([1, 1, 1, groups, group_size]);
            output = output.g_add(&(kernel * &shifted));
            output = output.addcmul(&dynamic.select(3, tap), &shifted);
        }
        output.reshape([batch, queries, hidden_size])
    }
}
