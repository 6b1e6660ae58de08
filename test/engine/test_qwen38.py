"""Qwen3.8 targets on tiny random checkpoints written by transformers' own save_pretrained.

Qwen3.8-27B is `model_type: qwen3_5` (Qwen3_5ForConditionalGeneration, Qwen3.6-27B's
layout: 3 Gated DeltaNet layers, then 1 attention layer, an MTP head); what changed is its
chat template, which takes `reasoning_effort`. Qwen3.8's largest MoE ships as a text-only
`qwen3_5_moe_text` checkpoint (Qwen3_5MoeForCausalLM, no text_config, 512 experts with 10
routed and 1 shared per token; 16 experts, 10 routed here).

QWEN38_TEMPLATE is our own, not Qwen's file: the official chat_template.jinja was not in
reach. It follows what public descriptions of it say (the ms-swift Qwen3.8 best-practice
page; the Qwen3.8 model card as quoted in projects that wired it up): `reasoning_effort` is
one of xhigh (the default), medium and low, any other value is refused with
raise_exception, and with thinking on the effort adds an instruction to the system message
(medium adds none). The instruction texts here are made up. Around that it is the ChatML
shape of the Qwen3.6 template our tokenizer's own template follows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
)

from flash_planner.engine.generate import GenerationSettings, encode_prompt, generate
from flash_planner.engine.inputs.chat import (
    TemplateError,
    TemplateVariableError,
    check_template_vars,
    encode_chat,
    template_takes,
)
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train.tiny import CORPUS, write_tiny_checkpoint
from flash_planner.train.tokenizer import train_tokenizer

TIMEOUT = 120
QWEN38_TEMPLATE = (
    "{% if reasoning_effort is defined and reasoning_effort is not none %}"
    "{% set effort = reasoning_effort %}{% else %}{% set effort = 'xhigh' %}{% endif %}"
    "{% if effort not in ['xhigh', 'medium', 'low'] %}"
    "{{ raise_exception('Unexpected reasoning effort ' ~ effort ~ '. Supported types are "
    "xhigh (default), medium, and low.') }}{% endif %}"
    "{% set thinking = enable_thinking is not defined or enable_thinking %}"
    "{% set guide = {'xhigh': 'Think it through carefully and thoroughly before answering.',"
    " 'low': 'Keep your thinking brief.'} %}"
    "{% set note = guide[effort] if thinking and effort in guide else '' %}"
    "{% if note and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\n{{ note }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.first and m['role'] == 'system' and note %}\n\n{{ note }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Plan with the skills."},
            {"role": "user", "content": "pick up the red cup and place it on the table"}]


def _use_template(path) -> None:
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = QWEN38_TEMPLATE
    tok.save_pretrained(str(path))


@pytest.fixture(scope="module")
def dense_27b(tmp_path_factory):
    """Qwen3.8-27B's shape in small: the multimodal wrapper, every 4th layer attention, an
    MTP head, and the reasoning_effort template."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen38_27b"), kind="hybrid_vl",
                                 attention_every=4, mtp=True, init=0.25)
    _use_template(path)
    return path


@pytest.fixture(scope="module")
def moe_text(tmp_path_factory):
    """Qwen3.8's largest MoE in small: a text-only qwen3_5_moe_text checkpoint."""
    path = tmp_path_factory.mktemp("qwen38_moe")
    ids = train_tokenizer(CORPUS * 4, path, vocab_size=368)
    config = Qwen3_5MoeTextConfig(
        vocab_size=max(384, ids["vocab_size"]), hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=16, num_experts_per_tok=10, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, rms_norm_eps=1e-6, eos_token_id=ids["eos_id"],
        pad_token_id=0, max_position_embeddings=4096, initializer_range=0.25,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]})
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():   # norms and GDN gates off their constant defaults
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(str(path))
    _use_template(path)
    return path


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_qwen38_27b_greedy_tokens_equal_transformers(dense_27b, make_engine):
    import json

    config = json.loads((dense_27b / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and "text_config" in config
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["text_config"]["layer_types"][:4] == ["linear_attention"] * 3 + [
        "full_attention"]
    engine = make_engine(dense_27b, prefill_chunk=7)
    assert "mtp" in engine.proposers
    settings = GenerationSettings(max_new_tokens=24, reasoning_effort="low")
    ids = encode_prompt(engine, MESSAGES, None, "low")
    result = generate(engine, MESSAGES, settings)
    assert result.stats.prompt_tokens == len(ids)
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(dense_27b),
                                                         dtype=torch.float32).eval()
    assert result.token_ids == _hf_greedy(hf, ids, 24)
    plain = generate(engine, ids, GenerationSettings(max_new_tokens=24, method="none"))
    assert plain.token_ids == result.token_ids


def test_qwen38_moe_text_checkpoint_greedy_tokens_equal_transformers(moe_text, make_engine):
    import json

    config = json.loads((moe_text / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and "text_config" not in config
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    engine = make_engine(moe_text, prefill_chunk=5)
    moe = engine.model_config.moe
    assert (moe.num_experts, moe.top_k, moe.shared_intermediate) == (16, 10, 64)
    ids = encode_prompt(engine, MESSAGES, False, "xhigh")
    result = generate(engine, MESSAGES, GenerationSettings(
        max_new_tokens=24, enable_thinking=False, reasoning_effort="xhigh"))
    hf = AutoModelForCausalLM.from_pretrained(str(moe_text), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    assert result.token_ids == _hf_greedy(hf, ids, 24)


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("effort", ["xhigh", "medium", "low"])
def test_reasoning_effort_is_rendered_by_the_template(moe_text, thinking, effort):
    tok = AutoTokenizer.from_pretrained(str(moe_text))
    assert template_takes(tok, "reasoning_effort")
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                   reasoning_effort=effort, **kwargs)
    ids = encode_chat(tok, MESSAGES, thinking, {"reasoning_effort": effort})
    assert ids == tok.encode(text, add_special_tokens=False)
    default = encode_chat(tok, MESSAGES, thinking)
    # the template's default is xhigh; medium adds nothing, and without thinking none does
    assert (ids == default) == (effort == "xhigh" or thinking is False)
    low = encode_chat(tok, MESSAGES, thinking, {"reasoning_effort": "low"})
    assert (ids == low) == (effort == "low" or thinking is False)
    assert encode_chat(tok, MESSAGES, thinking, {"reasoning_effort": None}) == default


def test_an_effort_the_template_refuses_or_does_not_take_is_a_clear_error(moe_text,
                                                                          hybrid_dir):
    tok = AutoTokenizer.from_pretrained(str(moe_text))
    with pytest.raises(TemplateError, match="Unexpected reasoning effort high"):
        encode_chat(tok, MESSAGES, None, {"reasoning_effort": "high"})
    with pytest.raises(TemplateError, match="Unexpected reasoning effort high"):
        check_template_vars(tok, {"reasoning_effort": "high"})
    check_template_vars(tok, {"reasoning_effort": "low"})
    demo = AutoTokenizer.from_pretrained(str(hybrid_dir))   # the planner's own template
    assert not template_takes(demo, "reasoning_effort")
    with pytest.raises(TemplateVariableError,
                       match="chat template does not take reasoning_effort") as info:
        encode_chat(demo, MESSAGES, None, {"reasoning_effort": "low"})
    assert info.value.name == "reasoning_effort"
    assert encode_chat(demo, MESSAGES, None, {"reasoning_effort": None}) == encode_chat(
        demo, MESSAGES)
    with pytest.raises(ValueError, match="cannot be passed as a chat template variable"):
        encode_chat(tok, MESSAGES, None, {"enable_thinking": False})
    with pytest.raises(ValueError, match="reasoning_effort must be a short lowercase word"):
        GenerationSettings(reasoning_effort="High")


@pytest.fixture(scope="module")
def qwen38_engine(moe_text, make_engine):
    return make_engine(moe_text, max_context=4096)


def _service(engine, **config) -> PlannerService:
    service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                             PlannerConfig(**{"max_new_tokens": 4, "constrain": False,
                                              **config}))
    service.start()
    return service


def test_the_service_passes_its_effort_and_warms_up_the_prefix_requests_use(qwen38_engine):
    service = _service(qwen38_engine, reasoning_effort="low")
    try:
        ids, prefix = service.prompt("open the drawer", "", True, reasoning_effort="low")
        other, _ = service.prompt("open the drawer", "", True)
        assert ids != other and ids[:len(prefix)] == prefix
        service.warm_up()
        hit = service.plan(PlanRequest("open the drawer"), timeout=TIMEOUT)
        assert hit.telemetry["prefix_hit"] is True
        assert hit.telemetry["prompt_tokens"] == len(ids)
        # a request's own effort changes the system prompt: not the warmed-up prefix
        medium = service.plan(PlanRequest("open the drawer", reasoning_effort="medium"),
                              timeout=TIMEOUT)
        assert medium.telemetry["prefix_hit"] is False
        plain, _ = service.prompt("open the drawer", "", True, reasoning_effort="medium")
        assert medium.telemetry["prompt_tokens"] == len(plain) < len(other)
        refused = service.plan(PlanRequest("open the drawer", reasoning_effort="high"),
                               timeout=TIMEOUT)
        assert refused.rejected and "reasoning_effort 'high'" in refused.error
        assert "Supported types are xhigh (default), medium, and low" in refused.error
    finally:
        service.stop()


def test_a_model_whose_template_lacks_reasoning_effort_refuses_it(hybrid_dir, make_engine):
    engine = make_engine(hybrid_dir, max_context=1024)
    with pytest.raises(ValueError, match="chat template does not take reasoning_effort"):
        _service(engine, reasoning_effort="low")
    service = _service(engine)
    try:
        result = service.plan(PlanRequest("open the drawer", reasoning_effort="low"),
                              timeout=TIMEOUT)
        assert result.rejected and service.submit(PlanRequest(
            "x", reasoning_effort="low")).invalid_field == "reasoning_effort"
        assert result.error == ("invalid request: the model's chat template does not take "
                                "reasoning_effort (its template never names it): leave "
                                "reasoning_effort unset for this model")
    finally:
        service.stop()
