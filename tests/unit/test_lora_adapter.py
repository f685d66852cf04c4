"""LoRA adapters in PEFT's format (deepinfer/lora): read into deepinfer's fused projections, their
products against PEFT's own on a tiny random Llama (the difference each adapted projection's
output makes), the batched products of rows of different adapters against one product per
adapter, and the adapters that cannot be served refused by name."""

from __future__ import annotations

import json

import pytest
import torch

peft = pytest.importorskip("peft")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from deepinfer.lora.adapter import LoRAAdapterError, load_adapter, projection_layout  # noqa: E402
from deepinfer.lora.ops import lora_gathered, lora_reference  # noqa: E402
from deepinfer.models.llama import LlamaForCausalLM as OurLlama  # noqa: E402

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def peft_adapter(tmp_path, targets, rank=4, alpha=8, seed=0, **options):
    torch.manual_seed(seed)
    base = LlamaForCausalLM(CONFIG)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                     init_lora_weights=False, **options))
    path = tmp_path / f"adapter{seed}"
    model.save_pretrained(path)
    return model.eval(), str(path)


def delta(module, x):
    """What PEFT's LoRA layer adds to its base projection's output (zeros for a plain projection)."""
    base = getattr(module, "base_layer", module)
    return module(x) - base(x)


def ours_layout():
    return projection_layout(OurLlama({**CONFIG.to_dict(), "architectures": ["LlamaForCausalLM"]}))


@torch.no_grad()
@pytest.mark.parametrize("use_rslora", [False, True])
def test_products_equal_peft(tmp_path, use_rslora):
    model, path = peft_adapter(tmp_path, ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                               use_rslora=use_rslora)
    adapter = load_adapter("a", path, 16, ours_layout())
    x = torch.randn(5, CONFIG.hidden_size)
    for i, layer in enumerate(model.base_model.model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        # PEFT's LoRA layer: base output + delta; the delta alone is the difference.
        deltas = {name: delta(getattr(attn, name), x) for name in ("q_proj", "k_proj", "v_proj")}
        a, b = adapter.weights[f"model.layers.{i}.self_attn.qkv_proj"]
        got = (x @ a.T) @ b.T
        want = torch.cat([deltas["q_proj"], deltas["k_proj"], deltas["v_proj"]], dim=-1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert not deltas["k_proj"].any()   # not adapted: its rows of B are zeros
        h = torch.randn(5, CONFIG.intermediate_size)
        a, b = adapter.weights[f"model.layers.{i}.mlp.down_proj"]
        torch.testing.assert_close((h @ a.T) @ b.T, delta(mlp.down_proj, h), atol=1e-5, rtol=1e-4)
        a, b = adapter.weights[f"model.layers.{i}.mlp.gate_up_proj"]
        gate_up = (x @ a.T) @ b.T
        torch.testing.assert_close(gate_up[:, CONFIG.intermediate_size:], delta(mlp.up_proj, x), atol=1e-5, rtol=1e-4)
        assert not gate_up[:, :CONFIG.intermediate_size].any()


def test_rows_of_different_adapters():
    torch.manual_seed(1)
    slots, rows, inputs, outputs, r = 4, 11, 16, 24, 6
    a, b = torch.randn(slots, r, inputs), torch.randn(slots, outputs, r)
    a[0], b[0] = 0, 0   # slot 0: the base model
    x = torch.randn(rows, inputs)
    which = torch.tensor([0, 1, 1, 3, 0, 2, 3, 3, 1, 0, 2])
    want = torch.stack([(x[i] @ a[s].T) @ b[s].T for i, s in enumerate(which.tolist())])
    torch.testing.assert_close(lora_reference(x, which, a, b), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lora_gathered(x, which, a, b), want, atol=1e-5, rtol=1e-5)
    assert not lora_gathered(x, torch.zeros(rows, dtype=torch.long), a, b).any()


@pytest.mark.parametrize("change,message", [
    ({"r": 64}, "r=64 is above max_lora_rank=16"),
    ({"use_dora": True}, "use_dora is set"),
    ({"bias": "all"}, "bias='all'"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ({"target_modules": ".*proj"}, "as a pattern"),
    ({"peft_type": "IA3"}, "only LORA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_unservable_adapters_are_refused_by_name(tmp_path, change, message):
    _, path = peft_adapter(tmp_path, ["q_proj"])
    config_file = f"{path}/adapter_config.json"
    config = json.load(open(config_file))
    config.update(change)
    json.dump(config, open(config_file, "w"))
    with pytest.raises(LoRAAdapterError, match=message.replace("(", r"\(").replace("*", r"\*")):
        load_adapter("a", path, 16, ours_layout())


def test_missing_files_and_foreign_shapes(tmp_path):
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        load_adapter("a", str(tmp_path), 16, ours_layout())
    _, path = peft_adapter(tmp_path, ["q_proj"])
    layout = ours_layout()
    layout["model.layers.0.self_attn.qkv_proj"] = (48, [32, 16, 16])   # a model of other widths
    with pytest.raises(LoRAAdapterError, match=r"qkv_proj part 0: lora_A \(4, 32\)"):
        load_adapter("a", path, 16, layout)


@torch.no_grad()
def test_greedy_tokens_equal_peft_per_adapter(tmp_path):
    """The engine's model with two adapters in slots (lora/slots.py), every row of a run taking one
    of them (or none): greedy tokens equal PEFT's generate with that adapter (or the base model),
    float32, on a tiny random Llama saved as a checkpoint."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.lora.slots import LoRASlots, step_rows

    torch.manual_seed(0)
    base = LlamaForCausalLM(CONFIG).eval()
    checkpoint = tmp_path / "base"
    base.save_pretrained(checkpoint)
    adapters = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = peft.get_peft_model(LlamaForCausalLM.from_pretrained(checkpoint).eval(),
                                    peft.LoraConfig(r=4 * seed, lora_alpha=16, init_lora_weights=False,
                                                    target_modules=list(("q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"))))
        with torch.no_grad():   # larger B, so the adapters change the greedy tokens
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(20)
        model.save_pretrained(tmp_path / f"a{seed}")
        adapters.append(model.eval())
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=64, num_kv_blocks=32, skip_tokenizer_init=True)
    slots = LoRASlots(llm.engine.executor.runner.model, max_loras=2, max_rank=8)
    for slot, seed in ((1, 1), (2, 2)):
        slots.place(slot, load_adapter(f"a{seed}", str(tmp_path / f"a{seed}"), 8, slots.layout))
    prompt = [5, 17, 33, 2, 41, 9]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for slot, reference in ((0, base), (1, adapters[0]), (2, adapters[1])):
        with step_rows(slot):
            got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  min_new_tokens=12)[0, len(prompt):].tolist()
        assert list(got) == want, slot
        outputs[slot] = list(got)
    assert outputs[0] != outputs[1] != outputs[2]   # the adapters change the answer
