//! A tiny, seeded Hugging Face model directory for tests, the golden parity
//! fixtures and `dflash init-tiny`, so nothing is ever downloaded.
//!
//! The directory looks like a real checkpoint: `config.json`,
//! `model.safetensors` (bf16, like released checkpoints), a byte-level BPE
//! `tokenizer.json` the `tokenizers` crate and Python `transformers` both
//! load, `tokenizer_config.json` with a ChatML `chat_template` (also written
//! as `chat_template.jinja`, the transformers 5 layout) and
//! `generation_config.json`. Everything is a pure function of the
//! [`TinyModelSpec`]: the weights come from a self-contained SplitMix64
//! generator rather than `rand`, whose `StdRng` stream may change between
//! releases and would silently invalidate committed fixtures.
//!
//! Special tokens follow Qwen: `<|endoftext|>` (padding), `<|im_start|>`,
//! `<|im_end|>` (end of turn, eos) and, for the drafter, a mask token
//! `<|MASK|>` named by `mask_token` in `tokenizer_config.json`; see
//! [`mask_token_id`].

use crate::target_model::{Architecture, ModelError};
use safetensors::tensor::TensorView;
use safetensors::Dtype as SafeDtype;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

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

/// Number of BPE merges learned from the built-in corpus.
const MERGE_COUNT: usize = 200;

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

/// What tiny model to write.
#[derive(Debug, Clone, PartialEq)]
pub struct TinyModelSpec {
    /// Qwen3 (tied embeddings, q/k norm) or Llama (untied, llama3 RoPE).
    pub architecture: Architecture,
    /// Seed of every weight; the same spec always gives the same bytes.
    pub seed: u64,
    pub hidden_size: i64,
    pub layers: usize,
    pub heads: i64,
    pub kv_heads: i64,
    pub intermediate: i64,
    /// Model vocabulary (embedding rows); at least the tokenizer's size,
    /// padded like Qwen pads its vocabulary.
    pub vocab: i64,
}

impl Default for TinyModelSpec {
    /// A tiny Qwen3: 8 layers so that 5 DFlash draft layers read the
    /// distinct target layers [1, 2, 3, 4, 5].
    fn default() -> Self {
        TinyModelSpec {
            architecture: Architecture::Qwen3,
            seed: 0,
            hidden_size: 64,
            layers: 8,
            heads: 4,
            kv_heads: 2,
            intermediate: 128,
            vocab: 512,
        }
    }
}

impl TinyModelSpec {
    /// A tiny Llama-3 with llama3 RoPE scaling and untied embeddings.
    pub fn llama() -> Self {
        TinyModelSpec {
            architecture: Architecture::Llama,
            seed: 1,
            hidden_size: 48,
            layers: 6,
            heads: 6,
            kv_heads: 2,
            intermediate: 96,
            vocab: 512,
        }
    }

    fn head_dim(&self) -> i64 {
        self.hidden_size / self.heads
    }

    fn validate(&self) -> Result<(), ModelError> {
        let invalid =
            |message: String| ModelError::InvalidInput(format!("tiny model spec: {message}"));
        if self.hidden_size <= 0
            || self.heads <= 0
            || self.kv_heads <= 0
            || self.intermediate <= 0
            || self.layers == 0
        {
            return Err(invalid(format!("sizes must be positive: {self:?}")));
        }
        if self.hidden_size % self.heads != 0 || self.head_dim() % 2 != 0 {
            return Err(invalid(format!(
                "hidden_size {} must split into {} heads of even width",
                self.hidden_size, self.heads
            )));
        }
        if self.heads % self.kv_heads != 0 {
            return Err(invalid(format!(
                "heads {} not a multiple of kv_heads {}",
                self.heads, self.kv_heads
            )));
        }
        Ok(())
    }
}

/// The token ids [`random_token_sequences`] draws from: ordinary tokens of
/// the tiny vocabulary (byte and merge tokens, no special token).
pub const ORDINARY_TOKEN_IDS: std::ops::Range<i64> = 3..300;

/// `count` token sequences of `length` drawn from `generator` over
/// [`ORDINARY_TOKEN_IDS`]: the demo's prompts and the tests' sequences.
pub fn random_token_sequences(
    count: usize,
    length: usize,
    generator: &mut impl rand::Rng,
) -> Vec<Vec<i64>> {
    (0..count)
        .map(|_| {
            (0..length)
                .map(|_| generator.random_range(ORDINARY_TOKEN_IDS))
                .collect()
        })
        .collect()
}

/// Writes the tiny model directory `dir` (created if missing).
pub fn write_tiny_model(dir: &Path, spec: &TinyModelSpec) -> Result<(), ModelError> {
    spec.validate()?;
    let tokenizer = TinyTokenizer::build();
    let tokenizer_size = tokenizer.size() as i64;
    if spec.vocab < tokenizer_size {
        return Err(ModelError::InvalidInput(format!(
            "tiny model spec: vocab {} is smaller than the tokenizer's {tokenizer_size} tokens",
            spec.vocab
        )));
    }
    std::fs::create_dir_all(dir).map_err(|source| io_error(dir, source))?;
    write_json(&dir.join("config.json"), &model_config(spec, &tokenizer))?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({
            "eos_token_id": tokenizer.special_id(IM_END_TOKEN),
            "pad_token_id": tokenizer.special_id(END_OF_TEXT_TOKEN),
            "do_sample": false,
        }),
    )?;
    write_json(&dir.join("tokenizer.json"), &tokenizer.tokenizer_json())?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &tokenizer.tokenizer_config_json(),
    )?;
    write_text(&dir.join("chat_template.jinja"), CHAT_TEMPLATE)?;
    write_weights(&dir.join("model.safetensors"), spec)
}

/// The id of the mask token of a model directory: the `mask_token` of its
/// `tokenizer_config.json` (a string or an `{"content": ..}` object),
/// looked up among `tokenizer.json`'s added tokens and vocabulary.
pub fn mask_token_id(dir: &Path) -> Result<i64, ModelError> {
    let config_path = dir.join("tokenizer_config.json");
    let config = read_json(&config_path)?;
    let mask_token = match config.get("mask_token") {
        Some(Value::String(content)) => content.clone(),
        Some(Value::Object(object)) => object
            .get("content")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| invalid_config(&config_path, "mask_token object has no \"content\""))?,
        _ => return Err(invalid_config(&config_path, "no \"mask_token\"")),
    };
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = read_json(&tokenizer_path)?;
    let added = tokenizer
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|token| token.get("content").and_then(Value::as_str) == Some(mask_token.as_str()))
        .and_then(|token| token.get("id"))
        .and_then(Value::as_i64);
    let in_vocabulary = || {
        tokenizer
            .get("model")
            .and_then(|model| model.get("vocab"))
            .and_then(|vocab| vocab.get(&mask_token))
            .and_then(Value::as_i64)
    };
    added.or_else(in_vocabulary).ok_or_else(|| {
        invalid_config(
            &tokenizer_path,
            &format!("mask token {mask_token:?} is not in the vocabulary"),
        )
    })
}

/// Where a model's mask token id came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskTokenSource {
    /// The `mask_token` of `tokenizer_config.json`.
    Tokenizer,
    /// No `mask_token`: the reference convention of the published DFlash
    /// drafters, the first id past the tokenizer's vocabulary (an unused
    /// embedding row of the model; 151669 for Qwen3-8B).
    ReservedPastVocabulary,
}

impl std::fmt::Display for MaskTokenSource {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            MaskTokenSource::Tokenizer => "the tokenizer's mask_token",
            MaskTokenSource::ReservedPastVocabulary => {
                "no mask_token: the reserved id past the tokenizer's vocabulary (DFlash convention)"
            }
        })
    }
}

/// The mask token id a drafter of the model in `dir` uses by default: the
/// tokenizer's `mask_token` when it has one, else the first id past the
/// tokenizer's vocabulary (largest id of `tokenizer.json`'s vocabulary and
/// added tokens, plus one), which must be a row of the model's embedding
/// (`vocab_size` in `config.json`). Checked before any run starts.
pub fn default_mask_token_id(dir: &Path) -> Result<(i64, MaskTokenSource), ModelError> {
    let config_path = dir.join("tokenizer_config.json");
    let has_mask_token = config_path.is_file()
        && read_json(&config_path)?
            .get("mask_token")
            .is_some_and(|value| !value.is_null());
    if has_mask_token {
        return Ok((mask_token_id(dir)?, MaskTokenSource::Tokenizer));
    }
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = read_json(&tokenizer_path)?;
    let vocabulary_ids = tokenizer
        .get("model")
        .and_then(|model| model.get("vocab"))
        .and_then(Value::as_object)
        .into_iter()
        .flat_map(|vocab| vocab.values().filter_map(Value::as_i64));
    let added_ids = tokenizer
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|token| token.get("id").and_then(Value::as_i64));
    let reserved = vocabulary_ids
        .chain(added_ids)
        .max()
        .map_or(0, |largest| largest + 1);
    let model_config_path = dir.join("config.json");
    let vocab_size = read_json(&model_config_path)?
        .get("vocab_size")
        .and_then(Value::as_i64)
        .ok_or_else(|| invalid_config(&model_config_path, "no integer \"vocab_size\""))?;
    if reserved >= vocab_size {
        return Err(invalid_config(
            &tokenizer_path,
            &format!(
                "no mask_token, and no reserved id past the tokenizer's vocabulary: id {reserved} \
                 is not below the model's vocab_size {vocab_size} (pass --mask-token-id)"
            ),
        ));
    }
    Ok((reserved, MaskTokenSource::ReservedPastVocabulary))
}

fn invalid_config(path: &Path, message: &str) -> ModelError {
    ModelError::InvalidConfig {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

fn io_error(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read_json(path: &Path) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|source| io_error(path, source))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })
}

fn write_text(path: &Path, text: &str) -> Result<(), ModelError> {
    std::fs::write(path, text).map_err(|source| io_error(path, source))
}

fn write_json(path: &Path, value: &Value) -> Result<(), ModelError> {
    let text = serde_json::to_string_pretty(value).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    write_text(path, &(text + "\n"))
}

fn model_config(spec: &TinyModelSpec, tokenizer: &TinyTokenizer) -> Value {
    let common = json!({
        "architectures": [spec.architecture.hf_class_name()],
        "model_type": spec.architecture.model_type(),
        "attention_bias": false,
        "attention_dropout": 0.0,
        "eos_token_id": tokenizer.special_id(IM_END_TOKEN),
        "pad_token_id": tokenizer.special_id(END_OF_TEXT_TOKEN),
        "head_dim": spec.head_dim(),
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": 4096,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "use_cache": true,
        "vocab_size": spec.vocab,
    });
    let specific = match spec.architecture {
        Architecture::Qwen3 => json!({
            "rope_theta": 1_000_000.0,
            "rope_scaling": null,
            "tie_word_embeddings": true,
            "max_window_layers": spec.layers,
            "sliding_window": null,
            "use_sliding_window": false,
        }),
        // Llama 3.1's values; with the tiny head_dim of 8 the four
        // wavelengths (6, 167, 4443, 118k) fall in all three llama3 bands
        // (kept, interpolated, divided by the factor).
        Architecture::Llama => json!({
            "rope_theta": 500_000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": false,
            "max_position_embeddings": 131072,
            "mlp_bias": false,
            "pretraining_tp": 1,
        }),
    };
    let mut merged = common;
    if let (Some(target), Value::Object(extra)) = (merged.as_object_mut(), specific) {
        target.extend(extra);
    }
    merged
}

/// SplitMix64: tiny, portable, and good enough for test weights.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut mixed = self.0;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        mixed ^ (mixed >> 31)
    }

    /// Uniform in (0, 1].
    fn next_unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Standard normal by Box-Muller.
    fn next_normal(&mut self) -> f64 {
        let radius = (-2.0 * self.next_unit().ln()).sqrt();
        radius * (2.0 * std::f64::consts::PI * self.next_unit()).cos()
    }
}

/// FNV-1a, to give each tensor its own stream independent of write order.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// How a tensor is initialised.
enum Init {
    /// N(0, std²).
    Normal(f64),
    /// 1 + N(0, std²), for norm weights (not exactly one, so a norm weight
    /// applied in the wrong place changes the result).
    AroundOne(f64),
}

fn random_bf16_bytes(seed: u64, name: &str, count: usize, init: &Init) -> Vec<u8> {
    let mut generator = SplitMix64(seed ^ name_hash(name));
    let mut bytes = Vec::with_capacity(count * 2);
    for _ in 0..count {
        let value = match init {
            Init::Normal(std) => std * generator.next_normal(),
            Init::AroundOne(std) => 1.0 + std * generator.next_normal(),
        };
        bytes.extend_from_slice(&half::bf16::from_f64(value).to_le_bytes());
    }
    bytes
}

/// Every tensor of the tiny model with its shape and initialisation, in
/// the order of the file.
fn weight_plan(spec: &TinyModelSpec) -> Vec<(String, Vec<i64>, Init)> {
    let hidden = spec.hidden_size;
    let head_dim = spec.head_dim();
    let query_width = spec.heads * head_dim;
    let key_value_width = spec.kv_heads * head_dim;
    // Linear layers scaled by 1/sqrt(fan_in) keep activations O(1) through
    // the stack, so every layer visibly contributes to the hidden states.
    let linear = |fan_in: i64| Init::Normal(1.0 / (fan_in as f64).sqrt());
    let norm = || Init::AroundOne(0.1);
    // A `[outputs, inputs]` linear weight, scaled by its fan-in.
    let projection = |name: &'static str, outputs: i64, inputs: i64| {
        (name, vec![outputs, inputs], linear(inputs))
    };
    let mut plan: Vec<(String, Vec<i64>, Init)> = vec![(
        "model.embed_tokens.weight".into(),
        vec![spec.vocab, hidden],
        Init::Normal(1.0),
    )];
    for layer in 0..spec.layers {
        let mut layer_plan = vec![
            ("input_layernorm", vec![hidden], norm()),
            projection("self_attn.q_proj", query_width, hidden),
            projection("self_attn.k_proj", key_value_width, hidden),
            projection("self_attn.v_proj", key_value_width, hidden),
            projection("self_attn.o_proj", hidden, query_width),
        ];
        if spec.architecture == Architecture::Qwen3 {
            layer_plan.push(("self_attn.q_norm", vec![head_dim], norm()));
            layer_plan.push(("self_attn.k_norm", vec![head_dim], norm()));
        }
        layer_plan.extend([
            ("post_attention_layernorm", vec![hidden], norm()),
            projection("mlp.gate_proj", spec.intermediate, hidden),
            projection("mlp.up_proj", spec.intermediate, hidden),
            projection("mlp.down_proj", hidden, spec.intermediate),
        ]);
        plan.extend(layer_plan.into_iter().map(|(name, shape, init)| {
            (format!("model.layers.{layer}.{name}.weight"), shape, init)
        }));
    }
    plan.push(("model.norm.weight".into(), vec![hidden], norm()));
    if spec.architecture == Architecture::Llama {
        plan.push((
            "lm_head.weight".into(),
            vec![spec.vocab, hidden],
            linear(hidden),
        ));
    }
    plan
}

fn write_weights(path: &Path, spec: &TinyModelSpec) -> Result<(), ModelError> {
    let plan = weight_plan(spec);
    let buffers: Vec<(String, Vec<usize>, Vec<u8>)> = plan
        .into_iter()
        .map(|(name, shape, init)| {
            let count = shape.iter().product::<i64>() as usize;
            let bytes = random_bf16_bytes(spec.seed, &name, count, &init);
            (
                name,
                shape.into_iter().map(|dim| dim as usize).collect(),
                bytes,
            )
        })
        .collect();
    let mut views = Vec::with_capacity(buffers.len());
    for (name, shape, bytes) in &buffers {
        let view = TensorView::new(SafeDtype::BF16, shape.clone(), bytes).map_err(|error| {
            ModelError::Safetensors {
                path: path.to_path_buf(),
                message: format!("tensor {name:?}: {error}"),
            }
        })?;
        views.push((name.clone(), view));
    }
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|error| {
        ModelError::Safetensors {
            path: path.to_path_buf(),
            message: error.to_string(),
        }
    })
}

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
struct TinyTokenizer {
    /// Token string → id, bytes first (id = byte value), then merges.
    vocabulary: BTreeMap<String, i64>,
    merges: Vec<(String, String)>,
    /// Special tokens in id order, after the BPE vocabulary.
    specials: Vec<(String, i64)>,
}

impl TinyTokenizer {
    fn build() -> Self {
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

    fn size(&self) -> usize {
        self.vocabulary.len() + self.specials.len()
    }

    fn special_id(&self, token: &str) -> i64 {
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

    fn tokenizer_json(&self) -> Value {
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

    fn tokenizer_config_json(&self) -> Value {
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

    #[test]
    fn weights_depend_on_seed_and_name_only() {
        let init = Init::Normal(1.0);
        let first = random_bf16_bytes(7, "a", 16, &init);
        assert_eq!(first, random_bf16_bytes(7, "a", 16, &init));
        assert_ne!(first, random_bf16_bytes(8, "a", 16, &init));
        assert_ne!(first, random_bf16_bytes(7, "b", 16, &init));
    }

    #[test]
    fn invalid_specs_are_rejected() {
        let odd_heads = TinyModelSpec {
            heads: 5,
            ..TinyModelSpec::default()
        };
        assert!(odd_heads.validate().is_err());
        let small_vocab = TinyModelSpec {
            vocab: 100,
            ..TinyModelSpec::default()
        };
        let directory = std::env::temp_dir().join("dflash-tiny-never-written");
        assert!(write_tiny_model(&directory, &small_vocab).is_err());
        assert!(!directory.exists());
    }
}
