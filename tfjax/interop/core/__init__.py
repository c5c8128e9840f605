"""The machinery every family shares, by concern:

  files     config.json and state dicts (safetensors, torch files) in; safetensors out
  rules     key rules: PyTorch keys <-> tfjax parameter paths, applied with every key checked;
            stacking for scanned layers
  tables    config tables: config.json keys <-> model fields (Family, Field, Fixed)
  convert   a family's load and save by its table and rules
  registry  what each family loads and exports, for `interop.load` and `interop.save`
and what several families share: `decoders` (GPT-2, Llama, Gemma), `towers` and `posemb`
(the ViT families), `encoder_decoder` (Marian, torch.nn.Transformer).

The names below are the former single `core` module's, for code that reads them from here.
"""

from tfjax.interop.core.convert import from_hf, import_params, key_prefix, to_hf
from tfjax.interop.core.files import (
    CONFIG,
    SAFETENSORS,
    StateDict,
    as_config,
    as_state_dict,
    listing,
    load_source,
    read_config,
    read_state_dict,
    write_safetensors,
)
from tfjax.interop.core.rules import (
    Path,
    Rule,
    conv,
    dense,
    export_state,
    finish,
    flatten,
    identity,
    import_state,
    linear,
    linear_out,
    merged_rows,
    norm,
    param_shapes,
    reshaped,
    rows_out,
    stacked_linear,
    unflatten,
    unrolled,
)
from tfjax.interop.core.tables import (
    LABELS,
    REQUIRED,
    TOKENS,
    Family,
    Field,
    Fixed,
    build,
    hf_config,
    model_fields,
)

__all__ = [
    "CONFIG",
    "LABELS",
    "REQUIRED",
    "SAFETENSORS",
    "TOKENS",
    "Family",
    "Field",
    "Fixed",
    "Path",
    "Rule",
    "StateDict",
    "as_config",
    "as_state_dict",
    "build",
    "conv",
    "dense",
    "export_state",
    "finish",
    "flatten",
    "from_hf",
    "hf_config",
    "identity",
    "import_params",
    "import_state",
    "key_prefix",
    "linear",
    "linear_out",
    "listing",
    "load_source",
    "merged_rows",
    "model_fields",
    "norm",
    "param_shapes",
    "read_config",
    "read_state_dict",
    "reshaped",
    "rows_out",
    "stacked_linear",
    "to_hf",
    "unflatten",
    "unrolled",
    "write_safetensors",
]
