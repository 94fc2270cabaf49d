"""Both expert-parallel modes on 8 emulated devices equal one device: logits, expert load, loss with the
auxiliary losses, and every parameter gradient; and so does routing replay through the trainer's step, on
FSDP, expert-parallel and context-parallel meshes (moe_mesh_check.py runs in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from moe_mesh_check import A2A_VARIANTS, CASES, REPLAY_CASES

TOL = 1e-5


# GLM-4.5 (sigmoid group-limited router, correction bias, shared experts split over tensor, a dense first layer):
# one expert-parallel and one tensor-parallel mesh, and replay through the trainer's step on the first.
GLM_CASES = ("ep@data2_fsdp4", "fsdp@data2_fsdp2_tensor2")


# DeepSeek-V3 (multi-head latent attention, the GLM router): a tensor-parallel mesh (heads over tensor, the
# latent rank over fsdp), and routing replay through the trainer's step with each row split over 4 devices
# (context parallelism: MLA's q/k and narrower v re-split by heads).
DEEPSEEK_CASES = ("fsdp@data2_fsdp2_tensor2", "fsdp@data2_context4")


# All-to-all expert parallelism's ragged exchange at model level (through its all_to_all stand-in on CPU): the
# extended tier; the default tier checks it in `a2a_direct` (the exchange alone, with adapters).
SLOW_A2A = ("a2a:ragged@data2_fsdp4",)
# The default tier runs one subprocess of four meshes (each mode once, each with its own split): expert
# parallelism by all-gather (forward, gradients and replay on data2 x fsdp4), the fsdp mode with tensor
# parallelism, all-to-all replay with each row split over 4 devices through the scanned stack, and the
# all-to-all exchange alone, and three reads of compiled steps: the layer loop's collectives, the experts kept
# gathered and the tokens kept exchanged. The other meshes form the extended tier (a second subprocess).
DEFAULT = (
    "ep@data2_fsdp4", "fsdp@data2_fsdp2_tensor2", "a2a@fsdp2_context4_scan", "a2a_direct", "layer_loop_collectives",
    "keep_gathered", "keep_exchanged",
)  # fmt: skip
EXTENDED = tuple(c for c in {*CASES, *REPLAY_CASES} if c not in (*DEFAULT, *SLOW_A2A))


def _tiered(cases) -> list:
    return [
        c if c in DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in cases if c not in SLOW_A2A
    ]


@pytest.fixture(scope="module")
def results(hf_model_dir, tmp_path_factory):
    return _run_check(hf_model_dir("qwen3_moe_e8k2_tied")[0], tmp_path_factory, DEFAULT)


@pytest.fixture(scope="module")
def extended_results(hf_model_dir, tmp_path_factory):
    return _run_check(hf_model_dir("qwen3_moe_e8k2_tied")[0], tmp_path_factory, EXTENDED)


def _result(request, case: str) -> dict:
    return request.getfixturevalue("results" if case in DEFAULT else "extended_results")


@pytest.fixture(scope="module")
def glm_results(hf_model_dir, tmp_path_factory):
    return _run_check(hf_model_dir("glm4_moe_g4_dense1")[0], tmp_path_factory, GLM_CASES)


def _run_check(model_dir, tmp_path_factory, only=()):
    out = tmp_path_factory.mktemp("moe_mesh") / "result.json"
    env = dict(
        os.environ,
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
    )
    script = Path(__file__).with_name("moe_mesh_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(out), *([",".join(only)] if only else [])],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", _tiered(CASES))
def test_expert_parallel_equals_single_device(case, request):
    r = _result(request, case)["cases"][case]
    assert r["logits_diff"] <= TOL and r["loss_diff"] <= TOL, r
    assert r["grad_diff"] <= TOL, f"{case}: gradients differ by {r['grad_diff']:.3e}"
    assert r["load_equal"], f"{case}: expert load differs"
    # experts split over fsdp (the `experts` rule), nothing else
    assert r["experts_spec"][:2] == [None, "fsdp"], r["experts_spec"]
    print(f"{case}: logits {r['logits_diff']:.1e} grads {r['grad_diff']:.1e}")


def test_padding_is_not_counted_in_expert_load(results):
    assert results["ref_load_total"] == 2 * (8 * 16 - 4) * 2  # layers x valid tokens x top-k


def test_recorded_experts_change_the_routing(results):
    """The replayed batch is not what the router picks on its own: a mesh path that dropped the recorded
    experts would give the free-routing values below, far outside the tolerances of the next test."""
    r = results["replay"]
    assert r["replayed_positions"] >= 100 and r["replays_crossing_context_shards"] >= 4, r
    assert not r["free_load_equal"]
    assert r["free_lp_diff"] > 1e-2 and r["free_loss_rel"] > 1e-5 and r["free_grads_max_rel"] > 1e-2, r


@pytest.mark.parametrize("case", _tiered(REPLAY_CASES))
def test_routing_replay_on_mesh_equals_single_device(case, request):
    r = _result(request, case)["replay"]["cases"][case]
    assert r["lp_diff"] <= TOL, f"{case}: logprobs differ by {r['lp_diff']:.3e}"
    assert r["loss_rel"] <= 2e-6, r
    assert r["grads_max_rel"] <= TOL, f"{case}: gradients differ by {r['grads_max_rel']:.3e} (relative)"
    assert r["load_equal"], f"{case}: the replayed expert load differs"
    context = REPLAY_CASES[case][1].get("context", 1)
    assert r["routed_spec"] == [None, ["data", "fsdp"], "context" if context > 1 else None], r["routed_spec"]


@pytest.mark.parametrize("case", _tiered(REPLAY_CASES))
def test_each_device_runs_experts_on_its_own_tokens_only(case, request):
    """Every mesh axis that splits the tokens (data, fsdp, context) splits the experts' work too: no token's
    expert MLP runs on two devices of a context group. Under 'ep' a device runs its experts on the tokens of
    its whole fsdp group (the all-gather), no more."""
    mode, sizes, _ = REPLAY_CASES[case]
    splits = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("context", 1)
    gathered = sizes.get("fsdp", 1) if mode == "ep" else 1  # fsdp and a2a: the device's own tokens
    replay = _result(request, case)["replay"]
    assert replay["cases"][case]["expert_tokens_per_device"] == [replay["tokens"] // splits * gathered]


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): one more 8-device subprocess per family
def test_glm4_moe_on_meshes_equals_single_device(glm_results):
    """GLM-4.5's logits, loss with the auxiliary losses, expert load and every gradient on an expert-parallel and
    a tensor-parallel mesh; routing replay through the trainer's step on the expert-parallel one."""
    for case in GLM_CASES:
        r = glm_results["cases"][case]
        assert r["logits_diff"] <= TOL and r["loss_diff"] <= TOL and r["grad_diff"] <= TOL, (case, r)
        assert r["load_equal"] and r["experts_spec"][:2] == [None, "fsdp"], (case, r)
    assert glm_results["ref_load_total"] == 2 * (8 * 16 - 4) * 2  # 2 sparse layers x valid tokens x top-2
    rep = glm_results["replay"]
    assert rep["replayed_positions"] >= 100 and rep["free_lp_diff"] > 1e-2, rep  # the replay matters
    r = rep["cases"]["ep@data2_fsdp4"]
    assert r["lp_diff"] <= TOL and r["loss_rel"] <= 2e-6 and r["grads_max_rel"] <= TOL and r["load_equal"], r


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): one more 8-device subprocess per family
def test_deepseek_v3_on_meshes_equals_single_device(hf_model_dir, tmp_path_factory):
    res = _run_check(hf_model_dir("deepseek_v3_qlora")[0], tmp_path_factory, DEEPSEEK_CASES)
    r = res["cases"]["fsdp@data2_fsdp2_tensor2"]
    assert r["logits_diff"] <= TOL and r["loss_diff"] <= TOL and r["grad_diff"] <= TOL and r["load_equal"], r
    assert r["kv_b_spec"] == [None, "fsdp", "tensor", None], r["kv_b_spec"]
    rep = res["replay"]
    assert rep["replayed_positions"] >= 100 and rep["free_lp_diff"] > 1e-2, rep  # the replay matters
    r = rep["cases"]["fsdp@data2_context4"]
    assert r["lp_diff"] <= TOL and r["loss_rel"] <= 2e-6 and r["grads_max_rel"] <= TOL and r["load_equal"], r
    print(f"deepseek_v3 meshes: {res['cases']} replay {rep['cases']}")


@pytest.mark.parametrize("exchange", ["padded", "ragged"])
@pytest.mark.parametrize("variant", list(A2A_VARIANTS))
@pytest.mark.parametrize("routing", ["random", "all_on_device0", "top3_two_on_device0"])
def test_all_to_all_experts_with_adapters_equal_single_device(exchange, variant, routing, results):
    """Expert parallelism by all-to-all (both exchanges; the ragged one through its all_to_all stand-in) with
    per-expert LoRA adapters equals one device: output and the gradients of tokens, scores, experts and
    adapters, also when every token routes to one device's experts (its whole receive buffer in use). With
    balanced-share slots ("capacity") the skewed routing needs extra rounds and more pairs than round 0's
    window and the random one does not, so both sides of both conditions are checked, forward and backward."""
    r = results["a2a_direct"][f"{exchange}:{variant}/{routing}"]
    assert r["y_diff"] <= TOL and r["grad_diff"] <= TOL, r
    assert r["grad_min_abs_sum"] > 0, r  # every gradient is exercised (none trivially zero)
    if variant != "worst":  # the skewed routings overflow round 0's pair window; top-2 takes a second round
        assert (r["rounds_needed"] > 1) == (routing == "all_on_device0"), r
        assert r["overflow"] == (routing != "random"), r
    else:
        assert r["rounds_needed"] == 1 and not r["overflow"], r


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): one more 8-device subprocess
def test_ragged_all_to_all_experts_on_model_equal_single_device(hf_model_dir, tmp_path_factory):
    """The ragged exchange in the whole model: logits, loss, gradients and load, and routing replay through
    the trainer's step, on data=2 x fsdp=4 against one device."""
    res = _run_check(hf_model_dir("qwen3_moe_e8k2_tied")[0], tmp_path_factory, SLOW_A2A)
    (case,) = SLOW_A2A
    r = res["cases"][case]
    assert r["logits_diff"] <= TOL and r["loss_diff"] <= TOL and r["grad_diff"] <= TOL and r["load_equal"], r
    r = res["replay"]["cases"][case]
    assert r["lp_diff"] <= TOL and r["loss_rel"] <= 2e-6 and r["grads_max_rel"] <= TOL and r["load_equal"], r
    assert r["expert_tokens_per_device"] == [res["replay"]["tokens"] // 8], r


# Qwen3.5 MoE (the hybrid DeltaNet / gated-attention stack, every MLP sparse, a gated shared expert): the same
# meshes as GLM-4.5 (the DeltaNet's context split is checked on the dense family, test_qwen3_5.py), replay on
# the expert-parallel one.
QWEN3_5_MOE_CASES = ("ep@data2_fsdp4", "fsdp@data2_fsdp2_tensor2")


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): one more 8-device subprocess per family
def test_qwen3_5_moe_on_meshes_equals_single_device(hf_model_dir, tmp_path_factory):
    res = _run_check(hf_model_dir("qwen3_5_moe_hybrid")[0], tmp_path_factory, QWEN3_5_MOE_CASES)
    for case in QWEN3_5_MOE_CASES:
        r = res["cases"][case]
        # gradients: the DeltaNet chunks' fp32 sums run in another order on a mesh (test_qwen3_5.py: 2.2e-5)
        assert r["logits_diff"] <= TOL and r["loss_diff"] <= TOL and r["grad_diff"] <= 1e-4, (case, r)
        assert r["load_equal"] and r["experts_spec"][:2] == [None, "fsdp"], (case, r)
    assert res["ref_load_total"] == 4 * (8 * 16 - 4) * 2  # 4 sparse layers x valid tokens x top-2
    rep = res["replay"]
    assert rep["replayed_positions"] >= 100 and rep["free_lp_diff"] > 1e-2, rep  # the replay matters
    r = rep["cases"]["ep@data2_fsdp4"]
    assert r["lp_diff"] <= TOL and r["loss_rel"] <= 2e-6 and r["grads_max_rel"] <= 1e-4 and r["load_equal"], r
    print(f"qwen3_5_moe meshes: {res['cases']} replay {rep['cases']}")


def test_all_to_all_experts_in_bf16_equal_single_device(results):
    """The training dtype: bf16 tokens, scores, experts and adapters through a second round and the pair window's
    overflow (every token on device 0's experts) stay bf16 and equal one device in bf16 to bf16's rounding
    (measured: output 0.5%, gradients 0.75% of their largest element; bf16's epsilon is 0.8%)."""
    r = results["a2a_direct"]["bf16/all_on_device0"]
    assert r["dtypes"] == ["bfloat16"], r
    assert r["y_rel"] <= 2e-2 and r["grad_rel"] <= 2e-2, r


def test_all_to_all_moves_each_token_once_per_device(results):
    """Mode a2a's exchanges at Qwen3-30B-A3B's routing ratio (8 of 32 experts over 4 devices), read from the
    compiled forward and backward: each token crosses once per device holding one of its experts, so every
    all-to-all holds P * N rows (one row per (token, expert) pair would take 1.5 * N * k = 3x more). Four in
    the forward (rows, expert ids, scores; outputs back) and the transposes of the three differentiable ones."""
    r = results["a2a_exchange_rows"]
    rows = r["devices"] * r["tokens_per_device"]
    assert r["exchanges"] == [[rows, r["k"]], [rows, r["hidden"]]], r
    assert r["count"] == 7, r


def test_layer_loop_holds_no_all_reduce(results):
    """The scanned layers' routing statistics are summed per device inside the loop and over devices once after
    it: the compiled loop (fsdp=8, experts `fsdp`) holds the weights' all-gathers and no all-reduce, which
    would queue before each layer's expert gather (it held one per layer before moe.router_partials)."""
    r = results["layer_loop_collectives"]
    assert r["all_gather"] > 0 and r["all_reduce"] == 0, r


def test_keep_gathered_experts_gathers_each_layer_once(results):
    """model.keep_gathered_experts (remat full, scanned layers, experts fsdp on fsdp=8): the same loss and
    gradients, and the compiled step gathers each layer's experts once (the forward), not again in the
    backward's recompute."""
    r = results["keep_gathered"]
    assert r["loss_diff"] <= TOL and r["grad_diff"] <= TOL, r
    assert r["moved"] == {"keep=False": [2, 2], "keep=True": [1, 1]}, r


def test_keep_exchanged_tokens_sends_each_layer_tokens_once(results):
    """model.keep_exchanged_tokens (remat full, scanned layers, experts a2a on data=2 x fsdp=4): the same loss
    and gradients, and the compiled step's hidden-width all-to-alls: the forward's two (tokens there, outputs
    back) and the backward's two, without the tokens sent again in the backward's recompute."""
    r = results["keep_exchanged"]
    assert r["loss_diff"] <= TOL and r["grad_diff"] <= TOL, r
    assert r["moved"] == {"keep=False": 5, "keep=True": 4}, r
