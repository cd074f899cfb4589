"""``confkv plan``: exact arithmetic on hand-checked cases, presets, traces and bad input."""

from __future__ import annotations

import json

import pytest

from confkv.plan import (
    ACCELERATORS,
    MODEL_PRESETS,
    PlanRequest,
    TraceSummary,
    make_plan,
    parse_memory,
    resolve_model,
    session_bytes,
)
from confkv.policies import parse_policy
from confkv_serve.commands import main

SPEC = "confkv:n_high=512,n_low=256,int8=1,w=128"


def _trace(tmp_path, budgets, name="t.json"):
    steps = [{"step": i, "budget": b, "kv_bytes": 1000 + i} for i, b in enumerate(budgets)]
    path = tmp_path / name
    path.write_text(json.dumps({"model": "smollm2", "policy": SPEC, "peak_kv_bytes": 5000, "steps": steps}))
    return path


def _request(**kw):
    base = dict(
        model=MODEL_PRESETS["smollm2-135m"],
        memory_bytes=10**9,
        policy=parse_policy(SPEC),
        context_tokens=1000,
        generated_tokens=24,
        weight_dtype="fp32",
        kv_dtype="fp16",
        utilization=1.0,
    )
    return PlanRequest(**(base | kw))


def test_presets_match_published_parameter_counts():
    published = {
        "smollm2-135m": 134_515_008,
        "llama-3-8b": 8_030_261_248,
        "mistral-7b": 7_241_732_096,
        "qwen2.5-7b": 7_615_616_512,
        "qwen2.5-32b": 32_763_876_352,
    }
    assert {k: m.params for k, m in MODEL_PRESETS.items()} == published


def test_hand_checked_smollm2_plan():
    plan = make_plan(_request())
    # weights 134,515,008 params x 4 B; pool = 1e9 - weights
    assert plan["weight_bytes"] == 538_060_032
    assert plan["kv_pool_bytes"] == 461_939_968
    # full fp16: 2 (K,V) x 3 heads x 64 dims x 2 B x 30 layers = 23,040 B/token, x 1024 tokens
    assert plan["kv_bytes_per_token_full"] == 23_040
    assert plan["full_session_bytes"] == 23_592_960
    assert plan["full_max_sessions"] == 19
    # confkv: per layer 128 FP tokens x 768 B + 384 INT8 tokens x 2*3*(64+2) B = 250,368; x 30
    assert plan["session_bytes_worst"] == 7_511_040
    assert plan["max_sessions_worst"] == 61


def test_trace_share_gives_expected_sessions(tmp_path):
    trace = TraceSummary.load(_trace(tmp_path, [512, 256, 256, 512]))
    assert trace.high_share == 0.5 and trace.peak_kv_bytes == 5000 and trace.mean_kv_bytes == 1001.5
    plan = make_plan(_request(trace=trace))
    # low: (128 x 768 + 128 x 396) x 30 = 4,469,760; expected = mean of high and low
    assert plan["trace"]["session_bytes_low"] == 4_469_760
    assert plan["trace"]["session_bytes_expected"] == 5_990_400
    assert plan["trace"]["max_sessions_expected"] == 77


def test_short_sessions_are_capped_by_tokens_seen():
    policy = parse_policy(SPEC)
    geometry = MODEL_PRESETS["smollm2-135m"].geometry(2)
    assert session_bytes(policy, geometry, 100) == geometry.full_bytes(100)
    assert session_bytes(parse_policy("full"), geometry, 4096) == 4096 * 23_040


def test_qwen32b_4k_full_cache_is_one_gib():
    plan = make_plan(
        _request(model=resolve_model("qwen2.5-32b"), memory_bytes=ACCELERATORS["h200"], context_tokens=0,
                 generated_tokens=4096, weight_dtype="bf16", kv_dtype="bf16", policy=parse_policy("full"))
    )  # fmt: skip
    assert plan["kv_bytes_per_token_full"] == 64 * 8 * 128 * 2 * 2
    assert plan["full_session_bytes"] == 2**30


def test_hf_config_and_memory_parsing(tmp_path):
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path / "config.json"))
    assert (spec.n_layers, spec.n_kv_heads, spec.head_dim) == (2, 2, 16)
    # per layer: attn 64*(64+32+32) + 64*64 = 12,288; mlp 3*64*128 = 24,576; norms 128; + embed + norm
    assert spec.params == 2 * (12_288 + 24_576 + 128) + 100 * 64 + 64
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("24GiB") == 24 * 2**30
    assert parse_memory("1.5") == 1_500_000_000
    assert parse_memory("H200") == ACCELERATORS["h200"]
    assert parse_memory("cpu") > 0
    assert parse_memory("1E9B") == 10**9
    for bad in ("0", "5k", "banana", "1e400", "9" * 400):  # the last two: past a float's range
        with pytest.raises(ValueError, match="memory"):
            parse_memory(bad)


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    trace = _trace(tmp_path, [512, 256, 256, 512])
    argv = ["plan", "--model", "smollm2", "--memory", "1GB", "--utilization", "1", "--weight-dtype", "fp32",
            "--kv-dtype", "fp16", "--context", "1000", "--generate", "24"]  # fmt: skip
    argv += ["--trace", str(trace), "--json", str(out)]
    assert main(argv) == 0
    plan = json.loads(out.read_text())
    assert plan["policy"] == parse_policy(SPEC).spec()  # the trace's policy is the default
    assert plan["max_sessions_worst"] == 61 and plan["trace"]["max_sessions_expected"] == 77
    table = capsys.readouterr().out
    assert "max sessions (worst)" in table and "61" in table


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--model", "no-such-model"],
        ["plan", "--memory", "lots"],
        ["plan", "--memory", "0GB"],
        ["plan", "--model", "llama-3-8b", "--memory", "1GB"],  # weights do not fit
        ["plan", "--policy", "confkv:n_high=-1"],
        ["plan", "--weight-dtype", "fp12"],
        ["plan", "--kv-dtype", "int4"],
        ["plan", "--utilization", "1.5"],
        ["plan", "--context", "0", "--generate", "0"],
        ["plan", "--trace", "/no/such/trace.json"],
        ["plan", "--params", "-3"],
    ],
)
def test_bad_input_exits_2(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # rejected while parsing (typed arguments)
        code = exc.code
    assert code == 2
    assert capsys.readouterr().err.startswith("confkv: error: ")


def test_bad_trace_and_negative_tokens(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"steps": [{"no": 1}]}')
    assert main(["plan", "--trace", str(bad)]) == 2
    assert "not a 'confkv generate --trace' file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["plan", "--context", "-5"])
    assert err.value.code == 2
