"""The machinery every family shares, by concern:

  files     config.json and state dicts (safetensors, torch files) in; safetensors out
  rules     key rules: PyTorch keys <-> tfjax parameter paths, applied with every key checked;
            stacking for scanned layers
  tables    config tables: config.json keys <-> model fields (Family, Field, Fixed)
  convert   a family's load and save by its table and rules
  registry  what each family loads and exports, for `interop.load` and `interop.save`
  multimodal  ...ForConditionalGeneration checkpoints read as their text model (WRAPPERS)
and what several families share: `decoders` (GPT-2, Llama, Gemma, Mixtral, Qwen3-MoE),
`towers` and `posemb` (the ViT families), `encoder_decoder` (Marian, torch.nn.Transformer).
"""
