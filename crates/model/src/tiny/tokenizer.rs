//! The tiny model's tokenizer: a byte-level BPE (GPT-2's byte map and
//! pre-tokenizer) whose merges are learned deterministically from
//! [`TOKENIZER_CORPUS`], with the Qwen special tokens after the BPE
//! vocabulary, serialised as the `tokenizer.json` and
//! `tokenizer_config.json` that the `tokenizers` crate and Python
//! `transformers` both load. Apart from the weights because the two share
//! nothing but the vocabulary size.

use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The mask token the DFlash drafter fills its blocks with.
pub const MASK_TOKEN: &str = "<|MASK|>";
/// Padding / document separator.
pub const END_OF_TEXT_TOKEN: &str = "<|endoftext|>";
/// Opens a ChatML turn.
pub const IM_START_TOKEN: &str = "<|im_start|>";
/// Closes a ChatML turn; the eos token of the tiny model.
pub const IM_END_TOKEN: &str = "<|im_end|>";

/// ChatML as Qwen renders it, without tools or reasoning. Written once as
/// the `chat_template` key and once as `chat_template.jinja`.
pub const CHAT_TEMPLATE: &str = "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/// Text the tokenizer's merges are learned from (and that the demo data can
/// draw on). Any UTF-8 text still tokenizes, byte by byte at worst.
pub const TOKENIZER_CORPUS: &str = "user assistant system \n\
The quick brown fox jumps over the lazy dog. A speculative decoding drafter proposes several tokens \
at once and the target model verifies them in one forward pass. The drafter is trained on the hidden \
states of the target, which are streamed from target servers through a broker to drafter servers. \
What is the capital of France? The capital of France is Paris. How many legs does a spider have? \
A spider has eight legs. Write a short poem about the sea. The sea is wide and blue, the waves are \
white and new. Please explain what a neural network is. A neural network is a function made of layers \
of weights that are learned from data. Thank you! You are welcome. Hello, how are you today? I am fine, \
thank you for asking. Count from one to ten: one two three four five six seven eight nine ten. \
0 1 2 3 4 5 6 7 8 9 10 100 2024 3.14";

/// Number of BPE merges learned from the built-in corpus.
const MERGE_COUNT: usize = 200;

/// GPT-2's reversible byte → printable character map used by byte-level
/// BPE (`Ġ` for a space, `Ċ` for a newline).
fn byte_to_char_table() -> [char; 256] {
    let printable = |byte: u32| {
        (0x21..=0x7E).contains(&byte)
            || (0xA1..=0xAC).contains(&byte)
            || (0xAE..=0xFF).contains(&byte)
    };
    let mut table = ['\0'; 256];
    let mut next_unprintable = 0u32;
    for byte in 0..256u32 {
        let code = if printable(byte) {
            byte
        } else {
            next_unprintable += 1;
            255 + next_unprintable
        };
        table[byte as usize] = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// Splits text like GPT-2's pre-tokenizer, closely enough for learning
/// merges: an optional leading space followed by a run of letters, digits or
/// other symbols; whitespace runs on their own.
fn pre_tokenize(text: &str) -> Vec<String> {
    #[derive(PartialEq, Clone, Copy)]
    enum Class {
        Letter,
        Digit,
        Space,
        Other,
    }
    let class_of = |character: char| {
        if character.is_alphabetic() {
            Class::Letter
        } else if character.is_numeric() {
            Class::Digit
        } else if character.is_whitespace() {
            Class::Space
        } else {
            Class::Other
        }
    };
    let mut words = Vec::new();
    let mut current = String::new();
    let mut current_class = None;
    for character in text.chars() {
        let class = class_of(character);
        let attaches = match current_class {
            None => false,
            Some(previous) if previous == class => true,
            // A single space joins the run that follows it.
            Some(Class::Space) => current == " ",
            Some(_) => false,
        };
        if !attaches && !current.is_empty() {
            words.push(std::mem::take(&mut current));
        }
        if !attaches || current_class == Some(Class::Space) {
            current_class = Some(class);
        }
        current.push(character);
    }
    if !current.is_empty() {
        words.push(current);
    }
    words
}

/// The byte-level BPE vocabulary of the tiny model.
pub(super) struct TinyTokenizer {
    /// Token string → id, bytes first (id = byte value), then merges.
    vocabulary: BTreeMap<String, i64>,
    merges: Vec<(String, String)>,
    /// Special tokens in id order, after the BPE vocabulary.
    specials: Vec<(String, i64)>,
}

impl TinyTokenizer {
    pub(super) fn build() -> Self {
        let table = byte_to_char_table();
        let mut vocabulary: BTreeMap<String, i64> = BTreeMap::new();
        for (byte, character) in table.iter().enumerate() {
            vocabulary.insert(character.to_string(), byte as i64);
        }
        // word (as symbols) → frequency
        let mut words: BTreeMap<Vec<String>, u64> = BTreeMap::new();
        for word in pre_tokenize(TOKENIZER_CORPUS) {
            let symbols = word
                .bytes()
                .map(|byte| table[byte as usize].to_string())
                .collect();
            *words.entry(symbols).or_default() += 1;
        }
        let mut merges = Vec::new();
        while merges.len() < MERGE_COUNT {
            let mut pair_counts: BTreeMap<(String, String), u64> = BTreeMap::new();
            for (symbols, frequency) in &words {
                for pair in symbols.windows(2) {
                    *pair_counts
                        .entry((pair[0].clone(), pair[1].clone()))
                        .or_default() += frequency;
                }
            }
            // Highest count; ties go to the smallest pair, for determinism.
            let Some((best_pair, _)) =
                pair_counts
                    .into_iter()
                    .max_by(|(pair_a, count_a), (pair_b, count_b)| {
                        count_a.cmp(count_b).then(pair_b.cmp(pair_a))
                    })
            else {
                break;
            };
            let merged = format!("{}{}", best_pair.0, best_pair.1);
            let next_id = vocabulary.len() as i64;
            vocabulary.entry(merged.clone()).or_insert(next_id);
            words = words
                .into_iter()
                .map(|(symbols, frequency)| (merge_pair(&symbols, &best_pair, &merged), frequency))
                .fold(BTreeMap::new(), |mut acc, (symbols, frequency)| {
                    *acc.entry(symbols).or_default() += frequency;
                    acc
                });
            merges.push(best_pair);
        }
        let first_special = vocabulary.len() as i64;
        let specials = [END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN]
            .iter()
            .enumerate()
            .map(|(offset, token)| (token.to_string(), first_special + offset as i64))
            .collect();
        TinyTokenizer {
            vocabulary,
            merges,
            specials,
        }
    }

    pub(super) fn size(&self) -> usize {
        self.vocabulary.len() + self.specials.len()
    }

    pub(super) fn special_id(&self, token: &str) -> i64 {
        self.specials
            .iter()
            .find(|(content, _)| content == token)
            .map(|(_, id)| *id)
            .unwrap_or(-1)
    }

    fn added_token_json(content: &str, id: i64) -> Value {
        json!({
            "id": id,
            "content": content,
            "single_word": false,
            "lstrip": false,
            "rstrip": false,
            "normalized": false,
            "special": true,
        })
    }

    pub(super) fn tokenizer_json(&self) -> Value {
        let added_tokens: Vec<Value> = self
            .specials
            .iter()
            .map(|(content, id)| Self::added_token_json(content, *id))
            .collect();
        let merges: Vec<String> = self
            .merges
            .iter()
            .map(|(left, right)| format!("{left} {right}"))
            .collect();
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added_tokens,
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": self.vocabulary,
                "merges": merges,
            },
        })
    }

    pub(super) fn tokenizer_config_json(&self) -> Value {
        let added_tokens_decoder: serde_json::Map<String, Value> = self
            .specials
            .iter()
            .map(|(content, id)| {
                let mut entry = Self::added_token_json(content, *id);
                if let Some(object) = entry.as_object_mut() {
                    object.remove("id");
                }
                (id.to_string(), entry)
            })
            .collect();
        json!({
            "add_bos_token": false,
            "add_prefix_space": false,
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": null,
            "eos_token": IM_END_TOKEN,
            "pad_token": END_OF_TEXT_TOKEN,
            "mask_token": MASK_TOKEN,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": false,
            "model_max_length": 4096,
            "split_special_tokens": false,
            "tokenizer_class": "PreTrainedTokenizerFast",
        })
    }
}

fn merge_pair(symbols: &[String], pair: &(String, String), merged: &str) -> Vec<String> {
    let mut output = Vec::with_capacity(symbols.len());
    let mut index = 0;
    while index < symbols.len() {
        if index + 1 < symbols.len() && symbols[index] == pair.0 && symbols[index + 1] == pair.1 {
            output.push(merged.to_string());
            index += 2;
        } else {
            output.push(symbols[index].clone());
            index += 1;
        }
    }
    output
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::TinyModelSpec;

    #[test]
    fn byte_table_is_a_bijection_with_gpt2_landmarks() {
        let table = byte_to_char_table();
        let distinct: std::collections::BTreeSet<char> = table.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[b'a' as usize], 'a');
    }

    #[test]
    fn pre_tokenizer_attaches_leading_spaces() {
        assert_eq!(
            pre_tokenize("Hello, world 42"),
            vec!["Hello", ",", " world", " 42"]
        );
    }

    #[test]
    fn tokenizer_is_deterministic_and_fits_the_default_vocab() {
        let first = TinyTokenizer::build();
        let second = TinyTokenizer::build();
        assert_eq!(first.merges, second.merges);
        assert_eq!(first.merges.len(), MERGE_COUNT);
        assert!(first.size() as i64 <= TinyModelSpec::default().vocab);
        let ids: Vec<i64> = first.specials.iter().map(|(_, id)| *id).collect();
        assert_eq!(ids, vec![456, 457, 458, 459]);
        // Every merged token has a unique id below the first special.
        let mut all_ids: Vec<i64> = first.vocabulary.values().copied().collect();
        all_ids.sort_unstable();
        assert_eq!(all_ids, (0..456).collect::<Vec<i64>>());
    }
}
