#!/usr/bin/env python3
"""A transformers model as a dflash target: reads a JSONL shard, runs the
frozen model forward and streams the DFlash hidden states into the broker.

What it sends matches the Rust target-server, sample for sample:
- target layers by the DFlash rule (`build_target_layer_ids`, Python's
  round-half-to-even) for --num-draft-layers, or --layer-ids; the state of
  layer i is `output_hidden_states[i + 1]`, concatenated on the last dim and
  sent as bf16 [T, n_layers * hidden];
- text conversations rendered with the model's chat template and tokenized
  without extra special tokens; the loss mask covers the assistant replies and
  the end-of-turn token closing each (the same span rule as
  services/target-server/src/data.rs); pre-tokenized lines
  (`input_ids`/`loss_mask`) pass through;
- when the run asks for it (the broker's `--target-capture last-hidden-states`,
  told in the welcome: `producer.capture_last_hidden_states`), also the last
  hidden state after the final norm (transformers' last `hidden_states` entry,
  the LM head's input) as `last_hidden_states` bf16 [T, hidden], what a DSpark
  drafter trains on;
- line i belongs to shard i mod --num-shards; `seq` is the sample's position
  in the shard (the Rust target-server numbers samples the same way when its
  --sort-window is 1; by default it sorts each window of 512 by length), and a
  restarted target skips every seq up to the broker's resume_after_seq.

    python hf_target.py --broker http://127.0.0.1:50051 --target-id target-0 \\
        --model /models/Qwen3-8B --data train.jsonl --num-shards 4 --shard-index 0

Ends with ReportDone and one JSON summary line on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_client import BrokerClient, ClientOptions, add_security_arguments, security_options

#: Markers that close a turn in common templates, after the tokenizer's eos.
END_OF_TURN_MARKERS = ["<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<|endoftext|>"]

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool",
}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """The reference rule: the middle layer for one draft layer, else
    round(1 + i * (L - 4) / (n - 1)) for i in 0..n (Python's round)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1
    return [round(1 + (index * span) / (num_draft_layers - 1)) for index in range(num_draft_layers)]


def content_text(content: Any) -> Optional[str]:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    return None


def parse_line(line: str) -> Tuple[str, Any]:
    """("tokens", (input_ids, loss_mask)) or ("messages", [{"role", "content"}])."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError('expected a JSON object with "input_ids", "messages" or "conversations"')
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError('"input_ids" must be a list of token ids')
        mask = record.get("loss_mask")
        mask = [1] * len(ids) if mask is None else [int(flag) for flag in mask]
        if len(mask) != len(ids) or any(flag not in (0, 1) for flag in mask):
            raise ValueError(f"loss_mask must be {len(ids)} values of 0 or 1")
        return "tokens", (ids, mask)
    for key, role_key, content_key, roles in (("messages", "role", "content", None), ("conversations", "from", "value", SHAREGPT_ROLES)):
        if key in record:
            entries = record[key]
            if not isinstance(entries, list) or not entries:
                raise ValueError(f"{key!r} must be a non-empty array")
            messages = []
            for position, entry in enumerate(entries):
                speaker = entry.get(role_key) if isinstance(entry, dict) else None
                role = speaker if roles is None else roles.get(speaker)
                text = content_text(entry.get(content_key)) if isinstance(entry, dict) else None
                if not isinstance(role, str) or text is None:
                    raise ValueError(f"{key}[{position}] has no usable {role_key!r}/{content_key!r}")
                message = {k: v for k, v in entry.items() if k not in (role_key, content_key)}
                message.update(role=role, content=text)
                messages.append(message)
            return "messages", messages
    raise ValueError('expected a JSON object with "input_ids", "messages" or "conversations"')


def assistant_spans(text: str, messages: Sequence[Dict[str, Any]], eos_token: Optional[str]) -> List[Tuple[int, int]]:
    """Character spans of the assistant replies in the rendered text, each
    extended over the end-of-turn marker that follows it."""
    markers = ([eos_token] if eos_token else []) + END_OF_TURN_MARKERS
    cursor, spans = 0, []
    for position, message in enumerate(messages):
        needle = message["content"].strip()
        if not needle:
            continue
        found = text.find(needle, cursor)
        if found < 0:
            raise ValueError(f"message {position} ({message['role']}) does not appear in the rendered template")
        end = found + len(needle)
        if message["role"] == "assistant":
            marker = next((marker for marker in markers if text.startswith(marker, end)), None)
            if marker:
                end += len(marker)
            spans.append((found, end))
        cursor = end
    return spans


def encode(tokenizer: Any, line: str, max_length: int) -> Tuple[List[int], List[int]]:
    kind, value = parse_line(line)
    if kind == "tokens":
        ids, mask = value
    else:
        text = tokenizer.apply_chat_template(value, tokenize=False)
        spans = assistant_spans(text, value, tokenizer.eos_token)
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoding["input_ids"])
        mask = [int(any(start < span_end and end > span_start for span_start, span_end in spans)) for start, end in encoding["offset_mapping"]]
    if not ids:
        raise ValueError("no tokens")
    return ids[:max_length], mask[:max_length]


def shard_lines(path: str, shard_index: int, num_shards: int) -> Iterator[Tuple[int, str]]:
    with open(path, encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            if index % num_shards == shard_index and line.strip():
                yield index + 1, line


@torch.inference_mode()
def hidden_states_for(model: Any, input_ids: List[int], layer_ids: List[int], device: torch.device, last: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """bf16 [T, len(layer_ids) * hidden] on the CPU and, with `last`, the
    last hidden state after the final norm, bf16 [T, hidden] (else None)."""
    output = model(input_ids=torch.tensor([input_ids], device=device), output_hidden_states=True, logits_to_keep=1)
    selected = torch.cat([output.hidden_states[layer_id + 1] for layer_id in layer_ids], dim=-1)
    last_hidden = output.hidden_states[-1][0].to(torch.bfloat16).cpu() if last else None
    return selected[0].to(torch.bfloat16).cpu(), last_hidden


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default="http://127.0.0.1:50051")
    parser.add_argument("--target-id", default="target-0")
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--data", required=True, help="JSONL: messages, conversations or input_ids/loss_mask")
    parser.add_argument("--num-draft-layers", type=int, default=5)
    parser.add_argument("--layer-ids", help="comma-separated target layers (default: the DFlash rule)")
    parser.add_argument("--max-length", type=int, default=3072)
    parser.add_argument("--shard-index", type=int, default=0)
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--max-bad-lines", type=int, default=0)
    parser.add_argument("--stats-interval-s", type=float, default=5.0)
    add_security_arguments(parser)  # --tls-ca, --tls-cert, --tls-key, --tls-domain, --token-file
    arguments = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= arguments.shard_index < arguments.num_shards:
        parser.error(f"--shard-index {arguments.shard_index} is out of range for {arguments.num_shards} shards")

    device = torch.device(arguments.device)
    dtype = getattr(torch, arguments.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    tokenizer = AutoTokenizer.from_pretrained(arguments.model)
    model = AutoModelForCausalLM.from_pretrained(arguments.model, dtype=dtype).to(device).eval()
    num_layers, hidden_size = model.config.num_hidden_layers, model.config.hidden_size
    if arguments.layer_ids:
        layer_ids = [int(part) for part in arguments.layer_ids.split(",")]
    else:
        layer_ids = build_target_layer_ids(num_layers, arguments.num_draft_layers)
    if any(not 0 <= layer_id < num_layers for layer_id in layer_ids):
        parser.error(f"layer ids {layer_ids} are outside the model's {num_layers} layers")
    width = len(layer_ids) * hidden_size
    logging.info("target layers %s, hidden_states width %d", layer_ids, width)

    samples_total = sum(1 for _ in shard_lines(arguments.data, arguments.shard_index, arguments.num_shards))
    with BrokerClient(arguments.broker, ClientOptions(**security_options(arguments))) as client:
        producer = client.producer(arguments.target_id, hidden_width=width)
        resume = producer.resume_after_seq
        # The run decides what each sample carries beyond DFlash's tensors.
        capture_last = producer.capture_last_hidden_states
        logging.info("welcome: resume after seq %s, run %r, epoch %d, capture %s", resume, producer.run_id, producer.epoch, list(producer.capture))
        seq, bad_lines, tokens_done, sent = 0, 0, 0, 0
        started = last_stats = time.monotonic()
        for line_number, line in shard_lines(arguments.data, arguments.shard_index, arguments.num_shards):
            try:
                input_ids, loss_mask = encode(tokenizer, line, arguments.max_length)
                if max(input_ids) >= model.config.vocab_size:
                    raise ValueError(f"token id {max(input_ids)} is outside the model's vocabulary of {model.config.vocab_size}")
            except ValueError as error:
                bad_lines += 1
                samples_total -= 1
                logging.warning("line %d: %s", line_number, error)
                if bad_lines > arguments.max_bad_lines:
                    raise SystemExit(f"{arguments.data}: {bad_lines} malformed lines, more than --max-bad-lines {arguments.max_bad_lines}") from error
                continue
            if resume is None or seq > resume:
                hidden, last_hidden = hidden_states_for(model, input_ids, layer_ids, device, capture_last)
                producer.send(seq, torch.tensor(input_ids), torch.tensor(loss_mask, dtype=torch.uint8), hidden, last_hidden_states=last_hidden)
                sent += 1
            seq += 1
            tokens_done += len(input_ids)
            if time.monotonic() - last_stats >= arguments.stats_interval_s:
                last_stats = time.monotonic()
                producer.send_stats(tokens_per_second=tokens_done / (last_stats - started), device=str(device), samples_done=seq, samples_total=samples_total, tokens_done=tokens_done)
        producer.send_stats(tokens_per_second=tokens_done / max(time.monotonic() - started, 1e-9), device=str(device), samples_done=seq, samples_total=samples_total, tokens_done=tokens_done)
        report = producer.finish()
        done = producer.report_done()
        producer.close()
    print(json.dumps({
        "target_id": arguments.target_id, "samples": seq, "sent": sent, "accepted_total": report.accepted_total,
        "duplicates": report.duplicates, "rejected": report.rejected, "reconnects": report.reconnects,
        "bad_lines": bad_lines, "done_targets": done["done_targets"], "expected_targets": done["expected_targets"],
    }))
    return 0 if not report.rejected else 1


if __name__ == "__main__":
    sys.exit(main())
