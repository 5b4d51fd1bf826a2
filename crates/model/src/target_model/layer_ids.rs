//! Which target layers a DFlash drafter reads.

/// The DFlash target layer ids for a target of `num_target_layers` layers
/// and a drafter of `num_draft_layers` layers, as in the reference
/// `build_target_layer_ids`: the middle layer for one draft layer, else
/// `round(1 + i * (L - 4) / (n - 1))` for `i in 0..n`, evenly spread from
/// layer 1 to layer L-3.
///
/// Python's `round` sends halves to the even neighbour (`round(20.5) == 20`);
/// `f64::round` would send them up and pick different layers, so this uses
/// `round_ties_even`. Returns an empty list when `num_draft_layers` is 0.
pub fn build_target_layer_ids(num_target_layers: usize, num_draft_layers: usize) -> Vec<usize> {
    match num_draft_layers {
        0 => Vec::new(),
        1 => vec![num_target_layers / 2],
        _ => {
            let start = 1.0;
            let span = num_target_layers as f64 - 3.0 - start;
            (0..num_draft_layers)
                .map(|index| {
                    let position = start + (index as f64 * span) / (num_draft_layers - 1) as f64;
                    position.round_ties_even().max(0.0) as usize
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_8b_with_five_draft_layers() {
        assert_eq!(build_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
    }

    #[test]
    fn halves_round_to_even_like_python() {
        // 1 + 3 * 26 / 4 = 20.5 -> 20 (Python), not 21.
        assert_eq!(build_target_layer_ids(30, 5), vec![1, 8, 14, 20, 27]);
        // 1 + 26 / 4 = 7.5 -> 8 (the even neighbour is above here).
        assert_eq!(build_target_layer_ids(30, 5)[1], 8);
    }

    #[test]
    fn single_draft_layer_takes_the_middle_layer() {
        assert_eq!(build_target_layer_ids(36, 1), vec![18]);
        assert_eq!(build_target_layer_ids(7, 1), vec![3]);
    }

    #[test]
    fn other_known_shapes() {
        assert_eq!(build_target_layer_ids(28, 5), vec![1, 7, 13, 19, 25]);
        assert_eq!(build_target_layer_ids(8, 5), vec![1, 2, 3, 4, 5]);
        assert_eq!(build_target_layer_ids(36, 2), vec![1, 33]);
        assert!(build_target_layer_ids(36, 0).is_empty());
    }
}
