"""Small Hugging Face decoders that `transformers` trained on one task, saved with their own
tokenizer (tokenizer.json), chat template and generation config: the starting checkpoints of
the fine-tuning tests.

The tasks work on words of the letters a-h: "copy" (the checkpoint's training) and "reverse"
(the fine-tune's), written as prompt / completion rows. Each family's tokenizer is a byte-level
BPE trained here on the tasks' text, with the family's special tokens added after the
vocabulary (so id 0 is the ordinary token "!", as in Llama 3 and Qwen) and its chat template.
"""

from __future__ import annotations

import json
import os

import numpy as np

LETTERS = "abcdefgh"
FAMILIES = ("llama", "qwen3", "gemma3", "qwen3_moe", "deepseek_v3", "qwen3_5", "llama4")

# Per family: special tokens (bos may be None), the eos ids generation stops at, and a chat
# template of the family's shape.
_SPECIAL = {
    "llama": dict(
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        extra=("<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"),
        stop=("<|end_of_text|>", "<|eot_id|>"),
        template=(
            "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
            "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}"
        ),
    ),
    "qwen3": dict(
        bos=None,
        eos="<|im_end|>",
        extra=("<|endoftext|>", "<|im_start|>"),
        stop=("<|im_end|>", "<|endoftext|>"),
        template=(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    ),
    "gemma3": dict(
        bos="<bos>",
        eos="<eos>",
        extra=("<end_of_turn>", "<start_of_turn>", "<pad>"),
        stop=("<eos>", "<end_of_turn>"),
        pad="<pad>",
        template=(
            "{{ bos_token }}{% for m in messages %}<start_of_turn>"
            "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
            "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
            "{% endif %}"
        ),
    ),
}
# Llama 4's: its header and end-of-turn tokens
_SPECIAL["llama4"] = dict(
    bos="<|begin_of_text|>",
    eos="<|end_of_text|>",
    extra=("<|eot|>", "<|header_start|>", "<|header_end|>"),
    stop=("<|end_of_text|>", "<|eot|>"),
    template=(
        "{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>"
        "\n\n{{ m['content'] }}<|eot|>{% endfor %}{% if add_generation_prompt %}"
        "<|header_start|>assistant<|header_end|>\n\n{% endif %}"
    ),
)
_SPECIAL["qwen3_moe"] = _SPECIAL["qwen3"]  # Qwen3-MoE's tokenizer is Qwen 3's
_SPECIAL["qwen3_5"] = _SPECIAL["qwen3"]  # Qwen3.5's special tokens and turns are Qwen 3's
# DeepSeek-V3's: its full-width bars and "▁" in the special tokens, a system prompt untagged
_SPECIAL["deepseek_v3"] = dict(
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    extra=("<｜User｜>", "<｜Assistant｜>"),
    stop=("<｜end▁of▁sentence｜>",),
    template=(
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>"
        "{{ m['content'] }}{% elif m['role'] == 'assistant' %}<｜Assistant｜>"
        "{{ m['content'] }}<｜end▁of▁sentence｜>{% else %}{{ m['content'] }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
    ),
)


def task_rows(task: str, n: int, seed: int) -> list[dict]:
    """n prompt / completion rows of `task` ("copy" or "reverse") on random words."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(list(LETTERS), rng.integers(3, 7)))
        answer = word if task == "copy" else word[::-1]
        rows.append({"prompt": f"{task} {word} =", "completion": f" {answer}"})
    return rows


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return os.fspath(path)


def _tokenizer(family: str):
    """A transformers fast tokenizer of the family's shape, trained on the tasks' text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    s = _SPECIAL[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [
        r["prompt"] + r["completion"] for t in ("copy", "reverse") for r in task_rows(t, 500, 0)
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    specials = [x for x in (s["bos"], s["eos"], *s["extra"]) if x]
    tok.add_special_tokens(specials)  # after the vocabulary: id 0 stays "!"
    if s["bos"]:
        bos_id = tok.token_to_id(s["bos"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{s['bos']} $A", pair=f"{s['bos']} $A $B", special_tokens=[(s["bos"], bos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=s["bos"], eos_token=s["eos"], pad_token=s.get("pad")
    )
    fast.chat_template = s["template"]
    return fast


def _model(family: str, vocab_size: int, ids: dict):
    import transformers

    sizes = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **ids,
    )
    if family == "llama":
        config = transformers.LlamaConfig(**sizes, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config)
    if family == "qwen3":
        config = transformers.Qwen3Config(**sizes, head_dim=16, tie_word_embeddings=True)
        return transformers.Qwen3ForCausalLM(config)
    if family == "qwen3_moe":
        # Qwen3-30B-A3B's shape, small: every layer a mixture of 4 experts, top-2 routing with
        # the k scores renormalised; trained with the load-balancing loss (output_router_logits)
        # so that the fine-tune adds it too (router_aux_loss_coef, its weight).
        config = transformers.Qwen3MoeConfig(
            **sizes,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            output_router_logits=True,
            router_aux_loss_coef=0.01,
            tie_word_embeddings=False,
        )
        return transformers.Qwen3MoeForCausalLM(config)
    if family == "deepseek_v3":
        # DeepSeek-V3's shape, small: latent attention with queries through a latent
        # (q_lora_rank), a dense first layer (first_k_dense_replace), then 8 experts in 4 groups
        # of which a token uses the best 2 (2 experts each, routed scale 2.5) and a shared one.
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]  # latent attention's
        config = transformers.DeepseekV3Config(
            **sizes,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            tie_word_embeddings=False,
        )
        return transformers.DeepseekV3ForCausalLM(config)
    if family == "qwen3_5":
        # Qwen3.5's shape, small: Gated DeltaNet (linear attention: 2 key heads, 4 value heads,
        # a convolution of 4) around one gated full-attention layer, RoPE on a quarter of each
        # head (partial_rotary_factor).
        sizes["num_hidden_layers"] = 3
        config = transformers.Qwen3_5TextConfig(
            **sizes,
            head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=False,
        )
        config.rope_parameters = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        }
        return transformers.Qwen3_5ForCausalLM(config)
    if family == "llama4":
        # Llama 4's shape, small: a dense layer (of intermediate_size_mlp), then a layer of 4
        # experts (one a token, its sigmoid score scaling its input) and a shared expert; the
        # first layer RoPE attending within chunks of 8, the second NoPE with the temperature
        # from position 7 on (floor_scale 8)
        sizes["intermediate_size"] = 32
        config = transformers.Llama4TextConfig(
            **sizes,
            head_dim=16,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=2,
            attention_chunk_size=8,
            floor_scale=8,
            tie_word_embeddings=False,
        )
        return transformers.Llama4ForCausalLM(config)
    config = transformers.Gemma3TextConfig(
        **sizes, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
    )
    return transformers.Gemma3ForCausalLM(config)


def encode(tokenizer, rows):
    """(ids, trained mask) per row: [bos] + prompt + completion + eos, completion and eos
    trained; the ids as transformers' tokenizer gives them."""
    out = []
    for row in rows:
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        prompt = tokenizer(row["prompt"], add_special_tokens=False).input_ids
        completion = tokenizer(row["completion"], add_special_tokens=False).input_ids
        ids = bos + prompt + completion + [tokenizer.eos_token_id]
        trained = [0] * (len(bos) + len(prompt)) + [1] * (len(completion) + 1)
        out.append((ids, trained))
    return out


def mean_loss(model, tokenizer, rows) -> float:
    """transformers' mean cross-entropy over the trained tokens (completions and eos) of rows."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ids, trained in encode(tokenizer, rows):
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
            nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
            mask = torch.tensor(trained[1:], dtype=torch.float64)
            total += float((nll * mask).sum())
            count += int(mask.sum())
    return total / count


def hf_loss(directory, rows) -> float:
    """mean_loss of the checkpoint saved in `directory`, loaded with from_pretrained."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    return mean_loss(model.eval(), tokenizer, rows)


def build(family: str, directory, *, steps: int = 150, seed: int = 0) -> str:
    """Trains a small `family` decoder on "copy" with transformers for `steps` steps (0: saved
    untrained) and saves it, its tokenizer and a generation config with the family's eos ids
    into `directory`."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # tiny matmuls: threads only contend with the test workers
    tokenizer = _tokenizer(family)
    s = _SPECIAL[family]
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = _model(family, len(tokenizer), ids)
    rows = encode(tokenizer, task_rows("copy", 2000, seed + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    model.train()
    for _ in range(steps):
        batch = [rows[i] for i in rng.integers(0, len(rows), 16)]
        width = max(len(ids) for ids, _ in batch)
        tokens = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for b, (row_ids, trained) in enumerate(batch):
            tokens[b, : len(row_ids)] = torch.tensor(row_ids)
            labels[b, : len(row_ids)] = torch.tensor(
                [t if m else -100 for t, m in zip(row_ids, trained, strict=True)]
            )
        loss = model(tokens, labels=labels).loss  # transformers shifts the labels itself
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in s["stop"]]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return os.fspath(directory)


def build_image_text(text_checkpoint, directory) -> str:
    """A Qwen3_5ForConditionalGeneration whose text model is the Qwen3.5 checkpoint in
    `text_checkpoint` (its weights, tokenizer and generation config) beside a 1-layer vision
    tower (random): what the image-text checkpoints hold for a text fine-tune."""
    import torch
    import transformers

    torch.manual_seed(0)
    text = transformers.Qwen3_5ForCausalLM.from_pretrained(text_checkpoint, dtype=torch.float32)
    vision = transformers.Qwen3_5VisionConfig(
        depth=1,
        hidden_size=16,
        intermediate_size=24,
        num_heads=2,
        out_hidden_size=text.config.hidden_size,
    )
    config = transformers.Qwen3_5Config(
        text_config=text.config.to_dict(),
        vision_config=vision.to_dict(),
        tie_word_embeddings=text.config.tie_word_embeddings,
    )
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.generation_config = text.generation_config
    model.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(text_checkpoint).save_pretrained(directory)
    return os.fspath(directory)


def hf_generate(directory, prompts, max_new_tokens=8) -> list[str]:
    """transformers' greedy continuations of `prompts` by the checkpoint in `directory`, up to
    its first stop id (the generation config's), as text without special tokens. The prompts
    are whole, as the run's samples show them (a bos written as text): none is added."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        tokens = model.eval().generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tokenizer.decode(tokens[0, ids.shape[1] :], skip_special_tokens=True))
    return out
