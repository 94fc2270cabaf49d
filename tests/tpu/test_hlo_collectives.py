"""primejax/trainer/hlo_collectives.py on the shapes of text the TPU compiler emits (no libtpu needed).

The excerpt below is condensed from `compiled.as_text()` of the trainer's step compiled for a v5e-4 slice
(tools/tpu_compile.py, the tiny debug model, scanned layers): signatures with `/*index=5*/` comments, a while
loop whose trip count is only in its condition, an all-gather split into start / continuation / done fusions
that each hold the same collective (one channel), and a reduce-scatter as an `all-reduce-scatter` fusion.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from primejax.trainer.hlo_collectives import collective_bytes

TPU_HLO = """\
HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(f32[384,32]{0,1:T(8,128)})->f32[]}

%fused_computation.881 (param_0.3032: bf16[1,32,2,32]) -> (bf16[1,32,2,32], bf16[1,128,2,32], s32[2], u32[], u32[], /*index=5*/u32[]) {
  %param_0.3032 = bf16[1,32,2,32]{3,2,0,1:T(2,128)(2,1)S(1)} parameter(0)
  %all-gather.178 = bf16[1,128,2,32]{3,2,0,1:T(2,128)(2,1)} all-gather(%param_0.3032), channel_id=162, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1] {'axis_0'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="5"}
  ROOT %custom-call.44 = (bf16[1,32,2,32]{3,2,0,1:T(2,128)(2,1)S(1)}, bf16[1,128,2,32]{3,2,0,1:T(2,128)(2,1)S(1)}, s32[2]{0:S(4)}, u32[]{:S(2)}, u32[]{:S(2)}, /*index=5*/u32[]{:S(2)}) custom-call(%all-gather.178), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.604 (param_0.3035: bf16[1,32,2,32], param_1.3638: bf16[1,128,2,32]) -> (f32[512,2], bf16[1,128,2,32]) {
  %param_0.3035 = bf16[1,32,2,32]{3,2,0,1:T(2,128)(2,1)S(1)} parameter(0)
  %all-gather.180 = bf16[1,128,2,32]{3,2,0,1:T(2,128)(2,1)S(1)} all-gather(%param_0.3035), channel_id=162, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1] {'axis_0'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="5"}
  ROOT %tuple.354 = (f32[512,2]{0,1:T(2,128)S(1)}, bf16[1,128,2,32]{3,2,0,1:T(2,128)(2,1)S(1)}) tuple(%param_0.3035, %all-gather.180)
}

%fused_computation.883 (param_0.3041: bf16[1,32,2,32]) -> bf16[1,128,2,32] {
  %param_0.3041 = bf16[1,32,2,32]{3,2,0,1:T(2,128)(2,1)S(1)} parameter(0)
  %all-gather.182 = bf16[1,128,2,32]{3,2,0,1:T(2,128)(2,1)} all-gather(%param_0.3041), channel_id=162, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1] {'axis_0'}, dimensions={1}, use_global_device_ids=true, frontend_attributes={chain_id="5"}
  ROOT %custom-call.46 = bf16[1,128,2,32]{3,2,0,1:T(2,128)(2,1)S(1)} custom-call(%param_0.3041, %all-gather.182), custom_call_target="AsyncCollectiveDone"
}

%all-reduce-scatter.7.clone.1 (input_0.2: bf16[128,128], input_1.2: bf16[128,2,32]) -> (bf16[128,32], bf16[32,2,32]) {
  %input_0.2 = bf16[128,128]{0,1:T(8,128)(2,1)S(1)} parameter(0)
  %input_1.2 = bf16[128,2,32]{2,0,1:T(8,128)(2,1)S(1)} parameter(1)
  %all-reduce.148 = (bf16[128,128]{0,1:T(8,128)(2,1)}, bf16[128,2,32]{2,0,1:T(8,128)(2,1)}) all-reduce(%input_0.2, %input_1.2), channel_id=30, replica_groups=mesh['axis_0'=4] {'axis_0'}, use_global_device_ids=true, to_apply=%add.15
  ROOT %tuple.9 = (bf16[128,32]{0,1:T(8,128)(2,1)}, bf16[32,2,32]{2,0,1:T(8,128)(2,1)}) tuple(%all-reduce.148, %all-reduce.148)
}

%add.15 (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %add = bf16[] add(%x, %y)
}

%wide.region_0.7_spmd.clone.clone.sunk (wide.param.85: (s32[], bf16[1,512,128], bf16[2,1,512,4,32], bf16[2,32,128], bf16[2,128,128], /*index=5*/bf16[2,32,2,32])) -> (s32[], bf16[1,512,128], bf16[2,1,512,4,32], bf16[2,32,128], bf16[2,128,128], /*index=5*/bf16[2,32,2,32]) {
  %dynamic-slice_convert_fusion.40 = bf16[1,32,2,32]{3,2,0,1:T(2,128)(2,1)S(1)} parameter(0)
  %async-collective-start.5 = (bf16[1,32,2,32]{3,2,0,1:T(2,128)(2,1)S(1)}, bf16[1,128,2,32]{3,2,0,1:T(2,128)(2,1)S(1)}, s32[2]{0:S(4)}, u32[]{:S(2)}, u32[]{:S(2)}, /*index=5*/u32[]{:S(2)}) fusion(%dynamic-slice_convert_fusion.40), kind=kCustom, calls=%fused_computation.881
  %fusion.604 = (f32[512,2]{0,1:T(2,128)S(1)}, bf16[1,128,2,32]{3,2,0,1:T(2,128)(2,1)S(1)}) fusion(%async-collective-start.5), kind=kCustom, calls=%async_collective_fusion.604
  %async-collective-done.5 = bf16[1,128,2,32]{3,2,0,1:T(2,128)(2,1)S(1)} fusion(%fusion.604), kind=kCustom, calls=%fused_computation.883
  %all-gather.225 = bf16[1,128,128]{3,2,0,1:T(2,128)(2,1)S(1)} all-gather(%async-collective-done.5), channel_id=161, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1] {'axis_0'}, dimensions={1}, use_global_device_ids=true
  ROOT %fusion.546 = (bf16[128,32]{0,1:T(8,128)(2,1)S(1)}, bf16[32,2,32]{2,0,1:T(8,128)(2,1)S(1)}) fusion(%all-gather.225), kind=kCustom, calls=%all-reduce-scatter.7.clone.1
}

%wide.region_5.8_spmd.clone.clone (wide.param.86: (s32[], bf16[1,512,128], bf16[2,1,512,4,32], bf16[2,32,128], bf16[2,128,128], /*index=5*/bf16[2,32,2,32])) -> pred[] {
  %constant.260.clone.3 = s32[]{:T(128)} constant(3)
  %wide.param.86 = (s32[]{:T(128)}, bf16[1,512,128]{1,2,0:T(8,128)(2,1)S(1)}, bf16[2,1,512,4,32]{2,4,3,1,0:T(8,128)(2,1)S(1)}, bf16[2,32,128]{2,1,0:T(8,128)(2,1)S(1)}, bf16[2,128,128]{2,1,0:T(8,128)(2,1)S(1)}, /*index=5*/bf16[2,32,2,32]{3,2,1,0:T(8,128)(2,1)S(1)}) parameter(0)
  %get-tuple-element.2131 = s32[]{:T(128)} get-tuple-element(%wide.param.86), index=0
  ROOT %lt.88 = pred[]{:T(512)} compare(%get-tuple-element.2131, %constant.260.clone.3), direction=LT
}

ENTRY %main.161_spmd (param.32: f32[384,32], param.46: f32[128], param.33: f32[2,128], param.45: f32[2,128,32], param.43: f32[2,32,128], /*index=5*/param.38: f32[2,32]) -> (f32[384,32], f32[128], f32[2,128], f32[2,128,32], f32[2,32,128], /*index=5*/f32[2,32]) {
  %tuple.1 = (s32[]{:T(128)}, bf16[1,512,128]{1,2,0:T(8,128)(2,1)S(1)}, bf16[2,1,512,4,32]{2,4,3,1,0:T(8,128)(2,1)S(1)}, bf16[2,32,128]{2,1,0:T(8,128)(2,1)S(1)}, bf16[2,128,128]{2,1,0:T(8,128)(2,1)S(1)}, /*index=5*/bf16[2,32,2,32]{3,2,1,0:T(8,128)(2,1)S(1)}) parameter(0)
  %while.64 = (s32[]{:T(128)}, bf16[1,512,128]{1,2,0:T(8,128)(2,1)S(1)}, bf16[2,1,512,4,32]{2,4,3,1,0:T(8,128)(2,1)S(1)}, bf16[2,32,128]{2,1,0:T(8,128)(2,1)S(1)}, bf16[2,128,128]{2,1,0:T(8,128)(2,1)S(1)}, /*index=5*/bf16[2,32,2,32]{3,2,1,0:T(8,128)(2,1)S(1)}) while(%tuple.1), condition=%wide.region_5.8_spmd.clone.clone, body=%wide.region_0.7_spmd.clone.clone.sunk
  %all-gather.221 = bf16[384,128]{0,1:T(8,128)(2,1)S(1)} all-gather(%param.32), channel_id=47, replica_groups=mesh['axis_0'=1,'axis_1'=4] {'axis_1'}, dimensions={1}, use_global_device_ids=true
  ROOT %all-reduce.76 = s32[2052]{0:T(1024)S(1)} all-reduce(%param.46), channel_id=107, replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add.15
}
"""


def test_tpu_scanned_step_counts_each_collective_once_per_layer():
    # the fused chain's channel 162 (once, not three times) + all-gather.225
    per_layer_gather = 1 * 128 * 2 * 32 * 2 + 1 * 128 * 128 * 2
    per_layer_scatter = (128 * 32 + 32 * 2 * 32) * 2  # the all-reduce-scatter fusion's result (bf16)
    assert collective_bytes(TPU_HLO) == {
        "all-gather": 3 * per_layer_gather + 384 * 128 * 2,  # 3 trips (the condition's bound) + the entry's
        "reduce-scatter": 3 * per_layer_scatter,
        "all-reduce": 2052 * 4,
    }


def test_within_loops_counts_only_the_loop_bodies():
    """The entry's own all-gather and all-reduce run outside the layer loop: within_loops leaves them out."""
    per_layer_gather = 1 * 128 * 2 * 32 * 2 + 1 * 128 * 128 * 2
    per_layer_scatter = (128 * 32 + 32 * 2 * 32) * 2
    assert collective_bytes(TPU_HLO, within_loops=True) == {
        "all-gather": 3 * per_layer_gather,
        "reduce-scatter": 3 * per_layer_scatter,
    }


def test_cpu_and_gpu_known_trip_count_still_wins():
    """A while whose backend config names its trip count (CPU/GPU compilers) uses that, not the condition."""
    hlo = TPU_HLO.replace(
        "body=%wide.region_0.7_spmd.clone.clone.sunk",
        'body=%wide.region_0.7_spmd.clone.clone.sunk, backend_config={"known_trip_count":{"n":"5"}}',
    )
    per_layer_gather = 1 * 128 * 2 * 32 * 2 + 1 * 128 * 128 * 2
    assert collective_bytes(hlo)["all-gather"] == 5 * per_layer_gather + 384 * 128 * 2


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp
    from flax import nnx
    from conftest import tiny_config
    from primejax.models.sharding import make_mesh
    from primejax.models.transformer import init_model
    from primejax.trainer.hlo_collectives import collective_bytes

    cfg = tiny_config(num_layers=3, scan_layers=True)
    mesh = make_mesh(1, 4, 1)  # fsdp=4: every layer's weights are gathered where they are used
    model = init_model(cfg, mesh, seed=0)
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((4, 32), jnp.int32)

    def forward(params, tokens):
        return nnx.merge(graphdef, params)(tokens, tokens, tokens).sum()

    with jax.set_mesh(mesh):
        text = jax.jit(forward).lower(params, tokens).compile().as_text()
    layers = jax.tree.leaves(nnx.state(model)["layers"])
    print(collective_bytes(text).get("all-gather", 0), sum(x.size * x.dtype.itemsize for x in layers))
    """
)


def test_cpu_scanned_step_gathers_every_layer():
    """The model's forward with scanned layers on a 4-device CPU mesh (fsdp=4): the all-gathers inside the
    layer loop count once per layer, so the forward gathers at least every layer's weights once (the parser
    once missed the loop body's header and counted 8 KB of 112 KB)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": root,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
    }
    here = os.path.join(root, "tests", "trainer")
    out = subprocess.run(
        [sys.executable, "-c", _CPU_SCRIPT, here], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    gathered, layer_weights = (int(x) for x in out.stdout.split())
    assert gathered >= layer_weights > 0, (gathered, layer_weights)


def test_tpu_loop_counter_start_is_subtracted():
    """A loop whose init tuple starts the counter at 1 (one iteration peeled) runs bound - 1 times."""
    head, rest = TPU_HLO.split("  %tuple.1 = ", 1)
    _, rest = rest.split("\n", 1)
    hlo = (
        head
        + "  %one = s32[]{:T(128)} constant(1)\n"
        + "  %x = bf16[1,512,128]{1,2,0:T(8,128)(2,1)S(1)} parameter(0)\n"
        + "  %tuple.1 = (s32[]{:T(128)}, bf16[1,512,128]{1,2,0:T(8,128)(2,1)S(1)}) tuple(%one, %x)\n"
        + rest
    )
    per_layer_gather = 1 * 128 * 2 * 32 * 2 + 1 * 128 * 128 * 2
    assert collective_bytes(hlo)["all-gather"] == 2 * per_layer_gather + 384 * 128 * 2


# Condensed from the Qwen3-235B-A22B step on v5p-128 (64 chips): the FSDP weight gathers are all-reduces of a
# zero buffer holding this chip's shard (a dynamic-update-slice, or a fusion ending in one), and the expert
# weights' gradients are two shard_map psums that share channel_id=1.
V5P_HLO = """\
HloModule jit_train_step, is_scheduled=true

%fused_computation.283.clone.1 (param_0.3300: bf16[1,128,64,2,16], param_1.4133: u32[], param_2.3450: bf16[94,2,64,2,16], param_3.2476: s32[]) -> bf16[1,128,64,2,16] {
  %param_0.3300 = bf16[1,128,64,2,16]{4,3,2,1,0:T(2,128)(2,1)} parameter(0)
  %param_2.3450 = bf16[94,2,64,2,16]{4,3,2,1,0:T(2,128)(2,1)} parameter(2)
  %param_1.4133 = u32[]{:T(128)} parameter(1)
  %param_3.2476 = s32[]{:T(128)} parameter(3)
  %constant.390.clone.81 = s32[]{:T(128)} constant(0)
  %dynamic-slice.234 = bf16[1,2,64,2,16]{4,3,2,1,0:T(2,128)(2,1)} dynamic-slice(%param_2.3450, %param_3.2476, %constant.390.clone.81, %constant.390.clone.81, %constant.390.clone.81, /*index=5*/%constant.390.clone.81), dynamic_slice_sizes={1,2,64,2,16}
  ROOT %dynamic-update-slice.105 = bf16[1,128,64,2,16]{4,3,2,1,0:T(2,128)(2,1)} dynamic-update-slice(%param_0.3300, %dynamic-slice.234, %constant.390.clone.81, %param_1.4133, %constant.390.clone.81, /*index=5*/%constant.390.clone.81, %constant.390.clone.81)
}

%body (wide.param.1: (s32[], bf16[94,2,64,2,16], bf16[94,64,64,8])) -> (s32[], bf16[94,2,64,2,16], bf16[94,64,64,8]) {
  %wide.param.1 = (s32[]{:T(128)}, bf16[94,2,64,2,16]{4,3,2,1,0:T(2,128)(2,1)}, bf16[94,64,64,8]{3,2,1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%wide.param.1), index=0
  %experts = bf16[94,2,64,2,16]{4,3,2,1,0:T(2,128)(2,1)} get-tuple-element(%wide.param.1), index=1
  %zero = bf16[]{:T(256)} constant(0)
  %broadcast.1997 = bf16[1,128,64,2,16]{4,3,2,1,0:T(2,128)(2,1)} broadcast(%zero), dimensions={}
  %broadcast.1992 = bf16[1,64,64,8]{3,2,1,0:T(8,128)(2,1)} broadcast(%zero), dimensions={}
  %offset = u32[]{:T(128)} constant(0)
  %fusion.568 = bf16[1,128,64,2,16]{4,3,2,1,0:T(2,128)(2,1)} fusion(%broadcast.1997, %offset, %experts, %i), kind=kLoop, calls=%fused_computation.283.clone.1
  %all-reduce.219 = bf16[1,128,64,2,16]{4,3,2,1,0:T(2,128)(2,1)} all-reduce(%fusion.568), channel_id=7, replica_groups=mesh['axis_0'=1,'axis_1'=64,'axis_2'=1,'axis_3'=1,'axis_4'=1] {'axis_1'}, use_global_device_ids=true, to_apply=%add.25
  %q_shard = bf16[1,1,64,8]{3,2,1,0:T(8,128)(2,1)} constant({...})
  %dynamic-update-slice.106 = bf16[1,64,64,8]{3,2,1,0:T(8,128)(2,1)} dynamic-update-slice(%broadcast.1992, %q_shard, %offset, %offset, %offset, %offset)
  %all-reduce.216 = bf16[1,64,64,8]{3,2,1,0:T(8,128)(2,1)} all-reduce(%dynamic-update-slice.106), channel_id=163, replica_groups=mesh['axis_0'=64,'axis_1'=1,'axis_2'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add.25
  %grad_gate_up = bf16[128,64,2,16]{3,2,1,0:T(2,128)(2,1)} bitcast(%all-reduce.219)
  %grad_down = bf16[128,16,64]{2,1,0:T(8,128)(2,1)} constant({...})
  %psum.21 = bf16[128,64,2,16]{3,2,1,0:T(2,128)(2,1)} all-reduce(%grad_gate_up), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63}}, to_apply=%add.25
  %psum.20 = bf16[128,16,64]{2,1,0:T(8,128)(2,1)} all-reduce(%grad_down), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63}}, to_apply=%add.25
  ROOT %tuple.7 = (s32[]{:T(128)}, bf16[94,2,64,2,16]{4,3,2,1,0:T(2,128)(2,1)}, bf16[94,64,64,8]{3,2,1,0:T(8,128)(2,1)}) tuple(%i, %experts, %psum.21)
}

%add.25 (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[]{:T(256)} parameter(0)
  %y = bf16[]{:T(256)} parameter(1)
  ROOT %add = bf16[]{:T(256)} add(%x, %y)
}

%cond (wide.param.2: (s32[], bf16[94,2,64,2,16], bf16[94,64,64,8])) -> pred[] {
  %wide.param.2 = (s32[]{:T(128)}, bf16[94,2,64,2,16]{4,3,2,1,0:T(2,128)(2,1)}, bf16[94,64,64,8]{3,2,1,0:T(8,128)(2,1)}) parameter(0)
  %layers = s32[]{:T(128)} constant(94)
  %j = s32[]{:T(128)} get-tuple-element(%wide.param.2), index=0
  ROOT %lt = pred[]{:T(512)} compare(%j, %layers), direction=LT
}

ENTRY %main.203_spmd (param.1: (s32[], bf16[94,2,64,2,16], bf16[94,64,64,8])) -> (s32[], bf16[94,2,64,2,16], bf16[94,64,64,8]) {
  %param.1 = (s32[]{:T(128)}, bf16[94,2,64,2,16]{4,3,2,1,0:T(2,128)(2,1)}, bf16[94,64,64,8]{3,2,1,0:T(8,128)(2,1)}) parameter(0)
  ROOT %while.54 = (s32[]{:T(128)}, bf16[94,2,64,2,16]{4,3,2,1,0:T(2,128)(2,1)}, bf16[94,64,64,8]{3,2,1,0:T(8,128)(2,1)}) while(%param.1), condition=%cond, body=%body
}
"""


def test_v5p_gathers_as_all_reduce_and_psums_sharing_a_channel():
    gathers = 128 * 64 * 2 * 16 * 2 + 64 * 64 * 8 * 2  # the fused and the plain zero-buffer gathers
    psums = 128 * 64 * 2 * 16 * 2 + 128 * 16 * 64 * 2  # both psums count, though both say channel_id=1
    assert collective_bytes(V5P_HLO) == {
        "all-gather-via-all-reduce": 94 * gathers,
        "all-reduce": 94 * psums,
    }


def test_a_computation_two_fusions_call_moves_its_collectives_twice():
    hlo = """\
HloModule m

%gathered (p: f32[8]) -> f32[32] {
  %p = f32[8]{0} parameter(0)
  ROOT %all-gather.1 = f32[32]{0} all-gather(%p), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (a: f32[8], b: f32[8]) -> (f32[32], f32[32]) {
  %a = f32[8]{0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %call.1 = f32[32]{0} fusion(%a), kind=kCustom, calls=%gathered
  %call.2 = f32[32]{0} fusion(%b), kind=kCustom, calls=%gathered
  ROOT %t = (f32[32]{0}, f32[32]{0}) tuple(%call.1, %call.2)
}
"""
    assert collective_bytes(hlo) == {"all-gather": 2 * 32 * 4}
