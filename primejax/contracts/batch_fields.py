"""The batch file's arrays: every [rows, seq_len] stream's name and dtype, and the loss components whose weight
streams it carries. The format itself (versions, manifest, packing) is batch.py's; its checks, batch_checks.py's;
both read these names from here.
"""

from __future__ import annotations

import numpy as np

# The loss components (trainer/losses.py), each normalized by its own token count and selected per token by
# its weight stream; the trainer's losses and the orchestrator's loss types read this one tuple.
LOSS_COMPONENTS = ("rl", "ce", "ref_kl")
# name -> dtype of every [rows, seq_len] array of a PackedBatch, in file order.
FIELDS: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32),
    "positions": np.dtype(np.int32),
    "segment_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.bool_),
    "inference_logprobs": np.dtype(np.float32),
    "advantages": np.dtype(np.float32),
    "temperatures": np.dtype(np.float32),
    "ref_logprobs": np.dtype(np.float32),
    # one weight stream per loss component: "<component>_weights"
    **{f"{c}_weights": np.dtype(np.float32) for c in LOSS_COMPONENTS},
    "env_ids": np.dtype(np.int32),
    "staleness": np.dtype(np.int32),
}
WEIGHT_STREAMS = tuple(f"{c}_weights" for c in LOSS_COMPONENTS)
OPTIONAL_STREAMS = ("advantages", "ref_logprobs", *WEIGHT_STREAMS)
