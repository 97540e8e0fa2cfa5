"""The family matrix: every decoder family the engine serves (hf_config.CHECKED_FAMILIES) runs greedy
token-identical to Hugging Face's eager reference, and the families it does not serve are refused at
load by name.

Each family is a tiny random-init checkpoint of its own configuration class (2 layers, 64 wide, 4 query
heads over 2 KV heads where the family has KV heads, peaked logits: initializer range 0.7), with what
makes the family itself left at its default or switched on: Gemma 2's soft-capping, gpt-oss's sinks,
sliding windows shorter than the prompts (Gemma 3, gpt-oss, Cohere 2, EXAONE 4, OLMo 3; mixed with
global layers where the family mixes them), Phi's partial rotary and biased dense layers, parallel
attention and MLP blocks (GPT-NeoX, GPT-J, Falcon, Cohere), GELU fc1/fc2 MLPs, LayerNorm with bias,
MoE experts (Mixtral, Qwen2/3-MoE, GraniteMoE, gpt-oss). Every family runs on each forward path of the
engine that applies on this machine: our kernels where they take the model (`kernels`), torch's modules
with padded SDPA (`torch`), compiled FlexAttention (`flex`), each plain and with n-gram drafting (suffix
drafting too on the torch path), against
greedy decoding by HF `generate` with eager attention. A difference must sit on a near-tie of the
target's top-2 logits (below NEAR_TIE) or the test fails.
"""
import copy

import pytest
import torch
import transformers

from conftest import make_engine, near_tie_mismatches, run_requests, tiers
from pipeline.engine import SamplingParams, TreeParams
from pipeline.engine.model.hf_config import CHECKED_FAMILIES

VOCAB, MAX_NEW = 512, 14
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.7, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
NO_KV_HEADS = {"num_key_value_heads": None}            # families whose configs name no KV heads (one per query head)
MOE = dict(num_experts_per_tok=2)
# model_type -> (config class, causal LM class, what the family sets beyond SIZES)
FAMILIES = {
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"sliding_window": 8}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": 8, "num_hidden_layers": 4,
                                                       "sliding_window_pattern": 2}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {**NO_KV_HEADS}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 4096,
                                                    "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8, "num_hidden_layers": 3,
                                                             "layer_types": ["sliding_attention", "sliding_attention",
                                                                             "full_attention"]}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 16}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {**NO_KV_HEADS, "n_embd": 64, "n_head": 4, "n_layer": 2}),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {**NO_KV_HEADS, "n_embd": 64, "n_head": 4,
                                                                 "n_layer": 2}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {**NO_KV_HEADS, "rotary_pct": 0.25}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {**MOE, "num_local_experts": 4, "head_dim": 16,
                                                     "sliding_window": 8}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {**NO_KV_HEADS, "rotary_dim": 8, "n_embd": 64, "n_head": 4,
                                              "n_layer": 2}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {**MOE, "num_local_experts": 4}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**MOE, "num_local_experts": 4, "sliding_window": None}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": 8, "num_hidden_layers": 4}),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", {**NO_KV_HEADS}),
    "phi": ("PhiConfig", "PhiForCausalLM", {**NO_KV_HEADS, "partial_rotary_factor": 0.5}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**MOE, "num_experts": 4, "moe_intermediate_size": 32,
                                                           "shared_expert_intermediate_size": 64}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "num_experts": 4, "moe_intermediate_size": 32,
                                                           "head_dim": 16}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 16}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": None}),
}
REFUSED = {
    "bloom": ("BloomConfig", "BloomForCausalLM", {**NO_KV_HEADS, "n_head": 4, "n_layer": 2}, "ALiBi"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {**MOE, "num_key_value_heads": 4, "n_routed_experts": 4, "moe_intermediate_size": 32,
                     "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                     "v_head_dim": 16, "n_group": 1, "topk_group": 1}, "multi-head latent attention"),
    "mamba": ("MambaConfig", "MambaForCausalLM", {}, "not among the families"),
}
PATHS = {   # make_engine's switches per forward path, and the drafters run on it
    "kernels": ({}, ("none", "ngram")),
    "torch": (dict(cpu_attention="off", cpu_linear="off", cpu_decoder="off"), ("none", "ngram", "suffix")),
    "flex": (dict(cpu_attention="off", cpu_decoder="off", compile="on"), ("none", "ngram")),
}
FAST = {"llama", "gemma2", "gpt_oss", "phi"}


def build(config_class: str, model_class: str, extra: dict):
    kwargs = {k: v for k, v in {**SIZES, **extra}.items() if v is not None or k != "num_key_value_heads"}
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


def eager(model):
    """A copy of the model on the family's eager attention: the reference."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    return reference


@torch.no_grad()
def greedy(reference, prompts) -> list[list[int]]:
    return [reference.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@torch.no_grad()
def mismatches(reference, prompts, outputs, references) -> int:
    """near_tie_mismatches with the top-2 gap of the reference's own logits (any family's head)."""
    def gap(tokens: list[int]) -> float:
        top = reference(torch.tensor([tokens])).logits[0, -1].double().topk(2).values
        return float(top[0] - top[1])
    return near_tie_mismatches(reference, prompts, outputs, references, gap)


@pytest.fixture(scope="module", autouse=True)
def _fresh_compiles():
    """The flex path compiles the attention for each family's head layout: dynamo's recompile limit (8
    variants per function in one process) would be spent on them, and later tests of this worker would
    run FlexAttention uncompiled (exact, but 10-30x slower). Compiled code is dropped before and after
    (inductor's disk cache keeps the kernels)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (41, 47, 52, 58)]


def test_the_matrix_covers_the_checked_families():
    assert sorted(FAMILIES) == sorted(CHECKED_FAMILIES)


@pytest.mark.parametrize("family", tiers(sorted(FAMILIES), FAST))
def test_family_greedy_identical_to_hf_on_every_path(family, prompts):
    model = build(*FAMILIES[family])
    assert model.config.model_type == family
    reference = eager(model)
    references = greedy(reference, prompts)
    for path, (switches, drafters) in PATHS.items():
        for kind in drafters:
            engine = make_engine(model, kind, max_num_seqs=4, max_model_len=128, **switches)
            done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
            outputs = [done[str(i)].output_ids for i in range(len(prompts))]
            plan = engine.target.plan.describe()
            assert mismatches(reference, prompts, outputs, references) <= 1, (family, path, kind, plan)
            features = engine.target.attention_features
            if features:          # the plan line names them
                aside = "our CPU kernel and FlexAttention do" if features.sinks else "our CPU kernel does"
                assert f"({features.describe()}; {aside} not compute them)" in plan, plan


def test_features_of_the_families_that_have_them():
    assert build(*FAMILIES["gemma2"]).config.attn_logit_softcapping == 5.0
    models = {f: build(*FAMILIES[f]) for f in ("gemma2", "gemma3_text", "gpt_oss", "llama")}
    engines = {f: make_engine(m, "none", max_num_seqs=2, max_model_len=128) for f, m in models.items()}
    described = {f: e.target.attention_features.describe() for f, e in engines.items()}
    assert described == {"gemma2": "soft-cap 5", "gemma3_text": "sliding window 8 on 2 of 3 layers",
                         "gpt_oss": "sinks, sliding window 8 on 1 of 2 layers", "llama": ""}
    assert "does not compute" not in engines["llama"].target.plan.describe()
    # why the model's modules run the forward, where our loop does not take it
    assert "modules_why=Gemma2ForCausalLM's attention has soft-cap 5" in engines["gemma2"].target.plan.describe()
    phi = build(*FAMILIES["phi"])
    runner = make_engine(phi, "none", max_num_seqs=2, max_model_len=128).target
    assert "modules_why=PhiForCausalLM: the loop knows" in runner.plan.describe()
    # its dense / fc1 / fc2 linears (other widths than q/k/v) planned like the rest, or none of them
    assert runner.planned in (0, sum(type(m) is torch.nn.Linear for m in phi.modules()))
    # a window at or past max_model_len never bites: the family runs on our kernels
    assert not make_engine(models["gemma3_text"], "none", max_num_seqs=2, max_model_len=8).target.attention_features
    with pytest.raises(ValueError, match="cpu_attention=on, but Gemma2ForCausalLM's attention has soft-cap 5"):
        make_engine(models["gemma2"], "none", max_num_seqs=2, max_model_len=128, cpu_attention="on")


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_the_engine_does_not_compute_are_refused_at_load(family):
    config_class, model_class, extra, reason = REFUSED[family]
    model = build(config_class, model_class, extra)
    with pytest.raises(ValueError, match=f"model type '{family}'.*{reason}"):
        make_engine(model, "none", max_num_seqs=2, max_model_len=128)


def test_a_draft_model_of_another_family(prompts):
    """Target and draft of different families over one vocabulary: the target's greedy tokens, drafts
    proposed and verified (a windowed, soft-capped Gemma-style target; a Qwen3 draft)."""
    target = build(*FAMILIES["gemma3_text"])
    draft = build(*FAMILIES["qwen3"])
    reference = eager(target)
    references = greedy(reference, prompts)
    engine = make_engine(target, "draft-greedy", draft, max_num_seqs=4, max_model_len=128)
    done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    outputs = [done[str(i)].output_ids for i in range(len(prompts))]
    assert mismatches(reference, prompts, outputs, references) <= 1
    assert sum(r.draft_len for r in rounds) > 0


@pytest.mark.parametrize("family", tiers(["gemma2", "gemma3_text", "gpt_oss"], {"gpt_oss"}))
def test_token_trees_over_soft_caps_sinks_and_windows(family, prompts):
    """Tree steps (each input seeing its ancestors only, at RoPE position start + depth) on the padded
    path and FlexAttention, with the family's features: the target's greedy tokens."""
    model = build(*FAMILIES[family])
    reference = eager(model)
    references = greedy(reference, prompts)
    for path in ("torch", "flex"):
        engine = make_engine(model, "suffix", max_num_seqs=4, max_model_len=128,
                             tree=TreeParams(max_tokens=8, max_branches=3), **PATHS[path][0])
        done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
        outputs = [done[str(i)].output_ids for i in range(len(prompts))]
        assert mismatches(reference, prompts, outputs, references) <= 1, (family, path)
        assert any(r.paths > 1 for r in rounds), "no step verified a tree"


def test_windows_at_long_context_on_flex_attention():
    """Keys over several FlexAttention blocks, in a windowed family (Gemma 3's local layers between global
    ones): the blocks every window has left are skipped, chains and token trees alike, and the tokens are
    the target's greedy ones."""
    model = build(*FAMILIES["gemma3_text"])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (290, 331)]
    reference = eager(model)
    references = greedy(reference, prompts)
    for tree in (None, TreeParams(max_tokens=8, max_branches=3)):
        engine = make_engine(model, "suffix", max_num_seqs=2, max_model_len=512, **({"tree": tree} if tree else {}),
                             **PATHS["flex"][0])
        done, rounds = run_requests(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
        outputs = [done[str(i)].output_ids for i in range(len(prompts))]
        assert mismatches(reference, prompts, outputs, references) <= 0, tree
        assert engine.target.flex is not None and sum(r.draft_len for r in rounds) > 0
