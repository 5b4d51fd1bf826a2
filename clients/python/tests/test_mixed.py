"""Python and Rust roles in one run, on the tiny Qwen3 of `dflash init-tiny`:
the Rust target-server feeding the example PyTorch drafter, a Python
producer feeding the Rust drafter-server, and the example transformers target
beside the Rust target-server on the same data, whose hidden states must agree
within bf16 rounding."""

from __future__ import annotations

import json
import pathlib
import subprocess

import numpy as np
import pytest
import torch

from dflash_client import BrokerClient
from harness import EXAMPLES, binary, consume_until_end, json_lines, python_process, wait_for_exits, wait_until, Process

HIDDEN, TARGET_LAYERS, DRAFT_LAYERS = 64, 8, 5
WIDTH = DRAFT_LAYERS * HIDDEN

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital of France is Paris."}]},
    {"messages": [{"role": "system", "content": "You are welcome."}, {"role": "user", "content": "How many legs does a spider have?"}, {"role": "assistant", "content": "A spider has eight legs."}]},
    {"conversations": [{"from": "human", "value": "Write a short poem about the sea."}, {"from": "gpt", "value": "The sea is wide and blue, the waves are white and new."}]},
    {"messages": [{"role": "user", "content": "Count from one to ten:"}, {"role": "assistant", "content": "one two three four five six seven eight nine ten"}, {"role": "user", "content": "Thank you!"}, {"role": "assistant", "content": "You are welcome."}]},
    {"messages": [{"role": "user", "content": "Please explain what a neural network is."}, {"role": "assistant", "content": "A neural network is a function made of layers of weights that are learned from data."}]},
    {"input_ids": [5, 17, 42, 99, 100, 7, 3, 250, 251, 252, 11, 12], "loss_mask": [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]},
    {"messages": [{"role": "user", "content": "Hello, how are you today?"}, {"role": "assistant", "content": "I am fine, thank you for asking. The quick brown fox jumps over the lazy dog."}]},
    {"messages": [{"role": "user", "content": "What does a speculative decoding drafter do?"}, {"role": "assistant", "content": "A speculative decoding drafter proposes several tokens at once and the target model verifies them in one forward pass."}]},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([binary("dflash"), "init-tiny", directory], check=True, capture_output=True)
    return directory


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in CONVERSATIONS))
    return path


def rust_target(log_dir, broker, tiny, data, target_id, *extra) -> Process:
    return Process(
        target_id,
        [binary("target-server"), "--broker", f"http://{broker.address}", "--target-id", target_id, "--model", tiny, "--data", data,
         "--device", "cpu", "--num-shards", "1", "--shard-index", "0", "--num-draft-layers", str(DRAFT_LAYERS), *extra],
        log_dir,
    )


def last_json(process: Process) -> dict:
    records = json_lines(process.log())
    assert records, f"{process.name} printed no summary:\n{process.log()[-4000:]}"
    return records[-1]


def test_rust_target_server_feeds_the_python_torch_drafter(start_broker, tiny, data, tmp_path):
    broker = start_broker(1)
    drafter = python_process(
        "torch-drafter",
        [EXAMPLES / "torch_drafter.py", "--broker", broker.address, "--drafter-id", "drafter-py", "--target-model", tiny,
         "--output", tmp_path / "draft", "--batch-samples", "3", "--num-anchors", "8", "--draft-layers", str(DRAFT_LAYERS)],
        tmp_path,
    )
    target = rust_target(tmp_path, broker, tiny, data, "target-0")
    wait_for_exits([target, drafter], 300)
    summary = last_json(drafter)
    assert summary["end_of_stream"] == "RUN_STATUS_COMPLETE", summary
    assert summary["samples_trained"] == len(CONVERSATIONS)
    assert summary["summary"]["accepted_items"] == len(CONVERSATIONS) == summary["summary"]["acked_items"]
    assert np.isfinite(summary["final_loss"]) and summary["steps"] >= 3
    # The saved draft is a reference DFlashDraftModel checkpoint.
    from dflash.model import DFlashDraftModel

    model, info = DFlashDraftModel.from_pretrained(tmp_path / "draft", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.target_layer_ids == [1, 2, 3, 4, 5]
    status = BrokerClient(broker.address).status()
    assert status["state"] == "BROKER_STATE_COMPLETE" and status["dead_letters"] == 0


def test_python_producer_feeds_the_rust_drafter_server(start_broker, tiny, tmp_path):
    broker = start_broker(1, "--target-ids", "target-py")
    output = tmp_path / "drafter-rs"
    drafter = Process(
        "drafter-server",
        [binary("drafter-server"), "--broker", f"http://{broker.address}", "--drafter-id", "drafter-rs", "--target-model", tiny,
         "--output", output, "--device", "cpu", "--num-anchors", "8", "--max-step-samples", "4", "--linger", "200ms", "--total-steps", "8"],
        tmp_path,
    )
    items = 12
    generator = np.random.default_rng(7)
    with BrokerClient(broker.address) as client:
        wait_until(lambda: any(d["connected"] for d in client.status()["drafters"]), 120, "the Rust drafter to connect",
                   children=[drafter, broker.process])
        producer = client.producer("target-py", hidden_width=WIDTH)
        for seq in range(items):
            length = int(generator.integers(16, 40))
            input_ids = generator.integers(0, 450, size=length).astype(np.int32)
            loss_mask = np.ones(length, dtype=np.uint8)
            loss_mask[: length // 4] = 0
            hidden = torch.from_numpy(generator.standard_normal((length, WIDTH)).astype(np.float32)).to(torch.bfloat16)
            producer.send(seq, input_ids, loss_mask, hidden)
        assert producer.finish().accepted_total == items
        producer.report_done()
        producer.close()
        assert drafter.wait(180) == 0, drafter.state_and_last_lines()
        status = client.status()
    assert status["state"] == "BROKER_STATE_COMPLETE", status
    assert (status["accepted_items"], status["acked_items"], status["dead_letters"]) == (items, items, 0)
    [rust] = [d for d in status["drafters"] if d["drafter_id"] == "drafter-rs"]
    # The broker acks a data-parallel step's samples with its commit, and the
    # commit of the last step completes the run: the drafter's stats of that
    # step come after its stream ended, and it waits until the broker has them.
    assert rust["acked_items"] == items and rust["stats"]["samples_trained"] == items
    latest = (output / "latest").read_text().strip()
    assert (output / latest / "model.safetensors").is_file()


def bf16_to_float(data: bytes, shape) -> np.ndarray:
    return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)


def test_hf_target_hidden_states_match_the_rust_target_server(start_broker, tiny, data, tmp_path):
    """The run asks for the last hidden state too (the broker's
    --target-capture, as a DSpark run does): both targets send it, read from
    their welcome, and it must agree as the tapped layers do.

    Both targets compute the tiny model in float32 and round to bf16 once
    (round to nearest even). Let x_r, x_p be the two float32 results for one
    value: they differ only by float32 reassociation error e (different
    matmul blocking, fused kernels), far below a bf16 step. Rounding moves
    each by at most half a bf16 ulp, and two numbers closer than one ulp
    round to the same or to adjacent bf16 values, so
    |bf16(x_r) - bf16(x_p)| <= ulp_bf16(max(|x_r|, |x_p|)) + e.
    e: each float32 dot product of n terms is off by at most n * 2^-24 * sum
    of |terms|; with n <= 128 (intermediate size) per op, 8 layers and
    RMSNorm keeping activations at the scale of the layer's largest value,
    e stays well under 2^-12 of that largest value (4096 float32 ulps, still
    1/32 of a bf16 ulp there). Any real divergence (a wrong layer, a wrong
    position, a different chat rendering) is orders of magnitude larger."""
    broker = start_broker(2, "--target-capture", "last-hidden-states")
    rust = rust_target(tmp_path, broker, tiny, data, "target-0", "--sort-window", "1", "--dtype", "f32")
    python = python_process(
        "hf-target",
        [EXAMPLES / "hf_target.py", "--broker", broker.address, "--target-id", "target-1", "--model", tiny, "--data", data,
         "--num-draft-layers", str(DRAFT_LAYERS), "--device", "cpu", "--dtype", "float32"],
        tmp_path,
    )
    received = {}
    with BrokerClient(broker.address) as client:
        with client.consumer("collector", credit_items=16) as consumer:
            for delivery in consume_until_end(consumer, [rust, python, broker.process], 300, "both targets' items and end-of-stream"):
                received[(delivery.target_id, delivery.seq)] = {name: (tensor.shape, tensor.data) for name, tensor in delivery.tensors.items()}
                consumer.ack(delivery)
            end = consumer.end_of_stream
    assert rust.wait(60) == 0, rust.state_and_last_lines()
    assert python.wait(60) == 0, python.state_and_last_lines()
    assert last_json(python)["accepted_total"] == len(CONVERSATIONS)
    assert end["status"] == "RUN_STATUS_COMPLETE" and end["summary"]["acked_items"] == 2 * len(CONVERSATIONS)
    assert sorted(received) == sorted((target, seq) for target in ("target-0", "target-1") for seq in range(len(CONVERSATIONS)))

    worst_ulps, identical, total = 0.0, 0, 0
    for seq in range(len(CONVERSATIONS)):
        rust_sample, python_sample = received[("target-0", seq)], received[("target-1", seq)]
        rust_ids = np.frombuffer(rust_sample["input_ids"][1], dtype="<i4")
        np.testing.assert_array_equal(np.frombuffer(python_sample["input_ids"][1], dtype="<i4"), rust_ids, err_msg=f"seq {seq} input_ids")
        mask = np.frombuffer(python_sample["loss_mask"][1], dtype="u1")
        np.testing.assert_array_equal(mask, np.frombuffer(rust_sample["loss_mask"][1], dtype="u1"), err_msg=f"seq {seq} loss_mask")
        assert mask.any() and not mask.all() or seq == 5, f"seq {seq}: loss mask should cover only the assistant replies"
        shape = rust_sample["hidden_states"][0]
        assert shape == python_sample["hidden_states"][0] == (len(rust_ids), WIDTH)
        rust_hidden = bf16_to_float(rust_sample["hidden_states"][1], shape)
        python_hidden = bf16_to_float(python_sample["hidden_states"][1], shape)
        magnitude = np.maximum(np.abs(rust_hidden), np.abs(python_hidden))
        exponent = np.floor(np.log2(np.maximum(magnitude, np.finfo(np.float32).tiny)))
        bf16_ulp = np.exp2(exponent - 7)
        # Per token row and per captured layer: the layer's largest magnitude.
        layer_scale = np.abs(rust_hidden).reshape(shape[0], DRAFT_LAYERS, HIDDEN).max(axis=2, keepdims=True)
        float32_error = np.broadcast_to(layer_scale * 2.0**-12, (shape[0], DRAFT_LAYERS, HIDDEN)).reshape(shape)
        difference = np.abs(rust_hidden - python_hidden)
        over = difference > bf16_ulp + float32_error
        assert not over.any(), (
            f"seq {seq}: {int(over.sum())} values differ by more than one bf16 ulp + e, "
            f"worst {difference[over].max()} at {np.argwhere(over)[0].tolist()}"
        )
        worst_ulps = max(worst_ulps, float((difference / bf16_ulp).max()))
        identical += int((difference == 0).sum())
        total += difference.size

        # The last hidden state (after the final norm): one "layer" of HIDDEN, same bound.
        last_shape = rust_sample["last_hidden_states"][0]
        assert last_shape == python_sample["last_hidden_states"][0] == (len(rust_ids), HIDDEN)
        rust_last = bf16_to_float(rust_sample["last_hidden_states"][1], last_shape)
        python_last = bf16_to_float(python_sample["last_hidden_states"][1], last_shape)
        magnitude = np.maximum(np.abs(rust_last), np.abs(python_last))
        bf16_ulp = np.exp2(np.floor(np.log2(np.maximum(magnitude, np.finfo(np.float32).tiny))) - 7)
        float32_error = np.abs(rust_last).max(axis=1, keepdims=True) * 2.0**-12
        difference = np.abs(rust_last - python_last)
        over = difference > bf16_ulp + float32_error
        assert not over.any(), (
            f"seq {seq} last_hidden_states: {int(over.sum())} values differ by more than one bf16 ulp + e, "
            f"worst {difference[over].max()} at {np.argwhere(over)[0].tolist()}"
        )
    print(f"hf_target vs target-server: {identical}/{total} bf16 values identical, worst difference {worst_ulps:.2f} bf16 ulps")
