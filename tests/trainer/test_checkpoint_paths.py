"""Run directories are usually relative (`run.output_dir = "outputs"`); Orbax only takes absolute paths."""

import jax.numpy as jnp
import numpy as np

from primejax.trainer.checkpoint import TrainerCheckpointer


def test_save_and_restore_under_a_relative_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "step": jnp.asarray(3, jnp.int32)}
    ckpt = TrainerCheckpointer("outputs/run", keep=2, async_save=True)
    ckpt.save(3, state, {"next_rollout_step": 4})
    ckpt.finalize()
    restored, meta = ckpt.restore(3, state)
    ckpt.close()
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
    assert int(restored["step"]) == 3 and meta["next_rollout_step"] == 4
    assert (tmp_path / "outputs" / "run" / "checkpoints" / "step_3" / "trainer").is_dir()
