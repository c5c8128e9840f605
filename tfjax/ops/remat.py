"""A layer stack's rematerialisation policies by name, and the check of a stack's options:
framework-free, shared by tfjax.specs, tfjax.nn's Stack (Linen) and tfjax.nnx's."""

import jax

LAYER_INPUT = "layer_input"  # checkpoint_name of each block's input, the residual stream
# What the backward pass of each layer finds saved from its forward pass; everything else is
# recomputed from the layer's input. The "offload_" policies move what they save from the
# accelerator's memory to the host's (pinned) memory during the forward pass and back during
# the backward pass (TPU and GPU; the host link carries those bytes twice per step). On the CPU
# backend JAX lowers those transfers as nothing, and that is kept, not refused: there the
# device memory is the host memory, so what offloading promises already holds, and an offload
# policy runs as its twin ("offload_dots_no_batch" as "dots_no_batch", "offload_layer_inputs"
# as "full") with the same numbers, so a TPU config's CPU smoke run works unchanged.
REMAT_POLICIES = {
    "none": None,  # no rematerialisation: keep every activation
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block
    "dots": jax.checkpoint_policies.checkpoint_dots,  # keep matmul outputs
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep x @ W
    # x @ W outputs (the projections; not attention's scores) go to host memory instead
    "offload_dots_no_batch": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        offload_src="device", offload_dst="pinned_host"
    ),
    # recompute the whole block, as "full", from its input kept in host memory
    "offload_layer_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=(LAYER_INPUT,),
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def check_stack(num_layers: int, remat_policy: str, variants) -> None:
    """A stack's options (this Stack's and tfjax.nnx's), each error naming its field."""
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(
            f"remat_policy={remat_policy!r} is unknown; allowed: {tuple(REMAT_POLICIES)}"
        )
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    if variants is not None and len(variants) != num_layers:
        raise ValueError(
            f"variants has {len(variants)} entries; it needs one per layer "
            f"(num_layers={num_layers})"
        )
