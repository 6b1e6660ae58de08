"""The vision tower (engine/models/qwen/vision.py) against transformers' own, on tiny random
Qwen3.5 / Qwen3.5-MoE vision-language checkpoints written by `save_pretrained`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version

from flash_planner.engine.checkpoint import CheckpointError, load_vision_tower
from flash_planner.engine.config import ConfigError
from flash_planner.engine.models.qwen.vision import VisionConfig

# (t, h, w) in patches: square and not, one frame each (an image) and two (a pair of frames)
GRIDS = [[(1, 4, 4)], [(1, 6, 8), (1, 2, 4)], [(2, 4, 6)], [(1, 10, 6), (1, 4, 4), (1, 8, 2)]]


def _transformers_model(path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(path, dtype=torch.float32).eval()


# transformers' Qwen3.5-VL reference before 5.24 is not 5.24's: it takes no mm_token_type_ids
# and its logits over images differ (5.2 was tried); the engine is checked against 5.24's
VL_REFERENCE = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason=f"the Qwen3.5-VL reference these compare with is transformers 5.24's (installed: "
           f"{transformers.__version__})")


@pytest.fixture(scope="module")
def wide_towers(checkpoints, tmp_path_factory):
    """kind -> (a copy of the tiny checkpoint (with an MTP head) whose tower has weights of
    std 0.2 and whose image token is IMAGE_TOKEN, transformers' model of it). The written
    weights (std 0.02) leave every activation near 0, where GELU's two forms agree to 1e-7;
    the written image token id lies outside the tiny vocabulary."""
    import json
    import shutil

    from vision_chat import widen_tower

    made = {}

    def get(kind):
        if kind not in made:
            source = checkpoints(kind, mtp=True, init=0.25)
            path = tmp_path_factory.mktemp(kind)
            for item in source.iterdir():
                if item.is_file():
                    shutil.copy(item, path / item.name)
            widen_tower(path)
            config = json.loads((path / "config.json").read_text())
            config["image_token_id"] = IMAGE_TOKEN
            (path / "config.json").write_text(json.dumps(config))
            model = _transformers_model(path)
            made[kind] = path, model
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["hybrid_vl", "hybrid_moe_vl"])
def test_the_tower_equals_transformers_for_images_of_several_sizes(wide_towers, kind):
    path, model = wide_towers(kind)
    theirs = model.model.visual
    ours = load_vision_tower(path)
    gen = torch.Generator().manual_seed(0)
    for grids in GRIDS:
        n = sum(t * h * w for t, h, w in grids)
        patches = torch.randn(n, ours.cfg.patch_dim, generator=gen)
        with torch.no_grad():
            want = theirs(patches, grid_thw=torch.tensor(grids)).pooler_output
            got = ours(patches, grids)
        m2 = ours.cfg.spatial_merge_size ** 2
        assert got.shape == (n // m2, ours.cfg.out_hidden_size) == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt, swapped", [
    ("ct-fp8-channel", "Fp8Linear"), ("ct-nvfp4", "Nvfp4Linear"), ("ct-w4a16", "Int4Linear"),
    ("qwen-fp8", None), ("modelopt-nvfp4", None)])
def test_a_quantized_checkpoints_tower_loads_as_stored_and_equals_its_dequantized_twin(
        wide_towers, tmp_path, make_engine, fmt, swapped):
    """compressed-tensors' recipes quantize the tower's Linears too unless told to ignore
    it: they load in their layout (with their biases). Qwen FP8 and ModelOpt leave it in full
    precision without naming it in their ignore lists: it loads as stored. Either way the
    tower equals the one of the dequantized twin, and so do greedy tokens after an image."""
    from quantized_checkpoints import write_quantized

    from flash_planner.engine.generate import GenerationSettings, generate
    from flash_planner.engine.inputs.images import ImageConfig, to_patches

    source, _ = wide_towers("hybrid_vl")
    quant, ref = write_quantized(source, tmp_path, fmt, kind="hybrid_vl")
    tower, twin = load_vision_tower(quant), load_vision_tower(ref)
    kinds = {type(m).__name__ for m in tower.modules()} - {type(m).__name__
                                                            for m in twin.modules()}
    assert kinds == ({swapped} if swapped else set())
    cfg = ImageConfig(patch_size=tower.cfg.patch_size, merge_size=tower.cfg.spatial_merge_size)
    image = to_patches(np.random.default_rng(4).integers(0, 256, (40, 24, 3), np.uint8), cfg)
    with torch.no_grad():
        got, want = tower(image.patches, [image.grid]), twin(image.patches, [image.grid])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    prompt, _ = _prompt([image], tower.cfg.spatial_merge_size, [[5, 9], [12, 3]])
    outs = [generate(make_engine(path), prompt, GenerationSettings(8, ignore_eos=True),
                     images=[image]).token_ids for path in (quant, ref)]
    assert outs[0] == outs[1]


def test_a_text_only_checkpoint_has_no_tower_and_says_so(checkpoints):
    with pytest.raises(CheckpointError, match="text-only.*cannot take images"):
        load_vision_tower(checkpoints("hybrid"))


def test_patches_that_do_not_fit_their_grids_are_refused(checkpoints):
    tower = load_vision_tower(checkpoints("hybrid_vl"))
    d = tower.cfg.patch_dim
    with pytest.raises(ValueError, match="hold 16 patches, got 12"):
        tower(torch.zeros(12, d), [(1, 4, 4)])
    with pytest.raises(ValueError, match="multiples of spatial_merge_size 2"):
        tower(torch.zeros(15, d), [(1, 3, 5)])
    with pytest.raises(ValueError, match=rf"\[N, {d}\]"):
        tower(torch.zeros(16, d + 1), [(1, 4, 4)])


def test_a_vision_config_names_the_field_it_cannot_use():
    good = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4,
                out_hidden_size=64, num_position_embeddings=16)
    assert VisionConfig.from_hf_dict(good, "x").patch_dim == 3 * 2 * 4 * 4
    for field, value, message in [("num_heads", 0, "num_heads must be a positive integer"),
                                  ("num_position_embeddings", 15, "not a square grid"),
                                  ("hidden_act", "relu6", "hidden_act 'relu6'"),
                                  ("hidden_size", 36, "head size divisible by 4")]:
        with pytest.raises(ConfigError, match=message):
            VisionConfig.from_hf_dict({**good, field: value}, "x")


IMAGE_TOKEN = 7          # an id of the tiny vocabulary the prompts never use otherwise


def _prompt(images, merge, text_ids):
    """Text, image, text (, image, text): ids with each image's tokens, and their spans."""
    from flash_planner.engine.inputs.mrope import ImageSpan

    ids, spans = list(text_ids[0]), []
    for image, text in zip(images, text_ids[1:]):
        t, h, w = image.grid
        grid = (t, h // merge, w // merge)
        spans.append(ImageSpan(len(ids), grid))
        ids += [IMAGE_TOKEN] * (grid[0] * grid[1] * grid[2]) + list(text)
    return ids, spans


@VL_REFERENCE
@pytest.mark.parametrize("kind", ["hybrid_vl", "hybrid_moe_vl"])
def test_the_target_over_images_equals_transformers_whole_chunked_and_decoding(wide_towers,
                                                                              kind):
    """Logits of a prompt with two images (tower embeddings in place of their tokens,
    (t, h, w) rotary positions), in one forward and in chunks split inside an image, then a
    decode step after it (rows shifted), equal transformers' forward with the same inputs."""
    from flash_planner.engine.checkpoint import load_checkpoint
    from flash_planner.engine.inputs.images import ImageConfig, to_patches
    from flash_planner.engine.inputs.mrope import prompt_positions
    from flash_planner.engine.state.cache import InferenceState

    path, theirs = wide_towers(kind)
    tower = load_vision_tower(path)
    ours = load_checkpoint(path, with_tokenizer=False).model
    cfg = ImageConfig(patch_size=tower.cfg.patch_size, min_pixels=8 * 8, max_pixels=64 * 64)
    rng = np.random.default_rng(1)
    images = [to_patches(rng.integers(0, 256, size, dtype=np.uint8), cfg)
              for size in ((40, 24, 3), (16, 56, 3))]
    ids, spans = _prompt(images, tower.cfg.spatial_merge_size,
                         [[11, 12, 13], [14, 15], [16, 17, 18, 19]])
    patches = torch.cat([im.patches for im in images])
    grids = [im.grid for im in images]
    next_id = 20
    with torch.no_grad():
        kind_ids = torch.tensor([[int(i == IMAGE_TOKEN) for i in ids + [next_id]]])
        want = theirs(input_ids=torch.tensor([ids + [next_id]]), pixel_values=patches,
                      image_grid_thw=torch.tensor(grids),
                      mm_token_type_ids=kind_ids).logits[0].float()
        embeds = tower(patches, grids)
    positions, shift = prompt_positions(len(ids), spans)
    assert shift < 0
    rows = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE_TOKEN])
    state = InferenceState(ours.cfg, capacity=64, max_steps=4, kv_dtype=torch.float32,
                           compute_dtype=torch.float32, device=torch.device("cpu"))
    whole = ours(torch.tensor([ids]), state, all_logits=True, image_rows=(rows, embeds),
                 rope_positions=positions).logits[0]
    torch.testing.assert_close(whole, want[:len(ids)], rtol=1e-4, atol=5e-4)
    # in chunks, the first ending inside the first image
    state.reset()
    cut = spans[0].start + 3
    for lo, hi in ((0, cut), (cut, len(ids))):
        inside = (rows >= lo) & (rows < hi)
        out = ours(torch.tensor([ids[lo:hi]]), state, all_logits=True,
                   image_rows=(rows[inside] - lo, embeds[inside]),
                   rope_positions=positions[:, lo:hi])
        state.commit(hi - lo)
    torch.testing.assert_close(out.logits[0, -1], want[len(ids) - 1], rtol=1e-4, atol=5e-4)
    # a decode step: its row turns at row + shift
    state.rope_shift = shift
    step = ours(torch.tensor([[next_id]]), state).logits[0, -1]
    torch.testing.assert_close(step, want[len(ids)], rtol=1e-4, atol=5e-4)


def test_image_positions_refuse_overlaps_and_a_saved_state_keeps_its_shift(checkpoints):
    from flash_planner.engine.checkpoint import load_checkpoint
    from flash_planner.engine.inputs.mrope import ImageSpan, prompt_positions
    from flash_planner.engine.state.cache import InferenceState

    positions, shift = prompt_positions(9, [ImageSpan(1, (1, 2, 3))])
    # text 0; the image's 2 x 3 tokens at 1 + (0, row, col); text after it from 1 + 3
    assert positions.tolist() == [[0, 1, 1, 1, 1, 1, 1, 4, 5],
                                  [0, 1, 1, 1, 2, 2, 2, 4, 5],
                                  [0, 1, 2, 3, 1, 2, 3, 4, 5]]
    assert shift == 6 - 9
    with pytest.raises(ValueError, match="overlap another image"):
        prompt_positions(20, [ImageSpan(2, (1, 2, 2)), ImageSpan(4, (1, 2, 2))])
    with pytest.raises(ValueError, match="pass the prompt's 5 rows"):
        prompt_positions(5, [ImageSpan(2, (1, 2, 2))])
    cfg = load_checkpoint(checkpoints("hybrid_vl"), with_tokenizer=False).config
    assert cfg.rope.mrope_section is not None
    state = InferenceState(cfg, capacity=8, max_steps=2, kv_dtype=torch.float32,
                           compute_dtype=torch.float32, device=torch.device("cpu"))
    state.rope_shift = -3
    copy = state.save()
    state.reset()
    assert state.rope_shift == 0
    state.load(copy)
    assert state.rope_shift == -3


# (text before, image sizes (H, W) in pixels with the text after each): one or two images
VISION_PROMPTS = [([11, 12, 13], [((40, 24), [14, 15])]),
                  ([21, 22], [((16, 56), [23]), ((24, 24), [24, 25, 26])]),
                  ([31, 32, 33, 34], [((48, 48), [35, 36])]),
                  ([41], [((8, 40), [42, 43]), ((32, 16), [44])]),
                  ([51, 52], [((100, 60), [53])]),           # scaled down into the budget
                  ([61, 62, 63], [((6, 6), [64, 65])]),      # scaled up to its least
                  ([71], [((24, 72), [72]), ((72, 24), [73, 74])]),
                  ([81, 82], [((33, 47), [83, 84, 85])])]


def _vision_requests(path, tower):
    from flash_planner.engine.inputs.images import ImageConfig, to_patches

    cfg = ImageConfig(patch_size=tower.cfg.patch_size, min_pixels=8 * 8, max_pixels=64 * 64)
    rng = np.random.default_rng(2)
    out = []
    for head, parts in VISION_PROMPTS:
        images = [to_patches(rng.integers(0, 256, (*size, 3), dtype=np.uint8), cfg)
                  for size, _ in parts]
        ids, _ = _prompt(images, tower.cfg.spatial_merge_size, [head] + [t for _, t in parts])
        out.append((ids, images))
    return out


@VL_REFERENCE
@pytest.mark.parametrize("kind", ["hybrid_vl", "hybrid_moe_vl"])
def test_greedy_tokens_after_images_equal_transformers_and_every_method_is_lossless(
        wide_towers, make_engine, tmp_path, kind):
    from flash_planner.engine.batch import Batch, BatchRequest
    from flash_planner.engine.generate import GenerationSettings, generate
    from flash_planner.engine.loop.proposer import ReplayProposer
    from flash_planner.train.tiny import write_tiny_drafter

    path, theirs = wide_towers(kind)
    drafter = write_tiny_drafter(tmp_path / "drafter", path)
    engine = make_engine(path, drafter_path=str(drafter), method="auto", mtp_steps=3,
                         prefill_chunk=8, prefix_cache=True)   # chunks end inside images
    assert engine.memory.vision == 0              # the tower loads on the first image
    n = 16
    requests = _vision_requests(path, engine.vision.tower)
    plain = []
    for ids, images in requests:
        patches = torch.cat([im.patches for im in images])
        with torch.no_grad():
            want = theirs.generate(
                input_ids=torch.tensor([ids]), pixel_values=patches,
                image_grid_thw=torch.tensor([im.grid for im in images]),
                mm_token_type_ids=torch.tensor([[int(i == IMAGE_TOKEN) for i in ids]]),
                max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        got = generate(engine, ids, GenerationSettings(n, ignore_eos=True, method="none"),
                       images=images)
        assert got.token_ids == want
        plain.append(got.token_ids)
        for method in ("dflash", "mtp", "auto"):
            spec = generate(engine, ids, GenerationSettings(n, ignore_eos=True, method=method),
                            images=images)
            assert spec.token_ids == want, method
        # one image token per image, as a chat template renders them: expanded
        collapsed = [i for k, i in enumerate(ids) if i != IMAGE_TOKEN or ids[k - 1] != i]
        assert len(collapsed) == len(ids) - sum(im.tokens for im in images) + len(images)
        assert generate(engine, collapsed, GenerationSettings(n, ignore_eos=True),
                        images=images).token_ids == want
        replay = ReplayProposer(want, engine.model_config.vocab_size, block_size=6, seed=3)
        spec = generate(engine, ids, GenerationSettings(n, ignore_eos=True), proposer=replay,
                        images=images)
        assert spec.token_ids == want and spec.stats.accepted > 0
        # the text before the image as a cached prefix: restored the second time
        for _ in range(2):
            cached = generate(engine, ids, GenerationSettings(n, ignore_eos=True),
                              prefix=ids[:1], images=images)
            assert cached.token_ids == want
        assert cached.stats.prefix_hit
    assert engine.vision.hits > 0        # the same frames again: their embeddings cached
    tower = sum(p.nbytes for p in engine.vision.tower.parameters())
    memory = engine.memory
    assert memory.vision > tower and memory.total == sum(
        getattr(memory, k) for k in ("weights", "kv_cache", "gdn_state", "checkpoints",
                                     "vision"))
    assert "vision" in str(memory)
    # batched: requests with images beside each other, each as alone
    batch = Batch(engine, max_batch=2)
    methods = ("none", "dflash", "mtp", "auto") * 2
    got = batch.run([BatchRequest(ids, GenerationSettings(n, ignore_eos=True, method=m),
                                  images=images)
                     for (ids, images), m in zip(requests, methods)])
    assert [g.token_ids for g in got] == plain


def test_the_text_after_images_runs_compiled_with_the_eager_tokens(wide_towers,
                                                                   make_engine):
    """After an image the rows turn by their cache position plus the request's rotary shift
    (InferenceState.rope_shift, a graph input): its decode steps and verifies run through
    the compiled graphs, target and MTP head, with eager's tokens."""
    from flash_planner.engine.config import cache_home
    from flash_planner.engine.generate import GenerationSettings, generate

    path, _ = wide_towers("hybrid_vl")
    common = dict(mtp_steps=3, max_block=4,
                  compile_cache=str(cache_home() / "test_torch_compile"))
    eager = make_engine(path, compile="off", **common)
    compiled = make_engine(path, compile="on", **common)
    static = compiled.model.static
    shifts = []
    for ids, images in _vision_requests(path, compiled.vision.tower)[:3]:
        for method in ("none", "mtp"):
            settings = GenerationSettings(16, ignore_eos=True, method=method)
            want = generate(eager, ids, settings, images=images)
            calls = static.calls
            got = generate(compiled, ids, settings, images=images)
            assert got.token_ids == want.token_ids, method
            assert static.calls - calls == got.stats.cycles > 0
            shifts.append(compiled.state.rope_shift)
    assert all(shift < 0 for shift in shifts)      # every request turned back by its images


def test_an_image_for_a_text_only_model_or_without_its_tokens_is_refused(
        wide_towers, checkpoints, make_engine):
    from flash_planner.engine.generate import GenerationSettings, generate

    path, _ = wide_towers("hybrid_vl")
    engine = make_engine(path, prefill_chunk=8)
    (ids, images), = _vision_requests(path, engine.vision.tower)[:1]
    with pytest.raises(ValueError, match="holds image tokens .* but no image was given"):
        generate(engine, ids, GenerationSettings(4))
    with pytest.raises(ValueError, match="image token runs of \\[\\] tokens for images of"):
        generate(engine, [i for i in ids if i != IMAGE_TOKEN], GenerationSettings(4),
                 images=images)
    text_only = make_engine(checkpoints("hybrid"))
    with pytest.raises(ValueError, match="text-only model .* cannot take images"):
        generate(text_only, [1, 2, 3], GenerationSettings(4), images=images)


@pytest.fixture(scope="module")
def chat_vl(wide_towers, tmp_path_factory):
    """The hybrid VL copy (its tower widened) with a chat template that renders image parts
    as Qwen's vision tokens, its image token the added `<|image_pad|>` (vision_chat.py)."""
    from vision_chat import vision_chat_copy

    source, _ = wide_towers("hybrid_vl")
    return vision_chat_copy(source, tmp_path_factory.mktemp("chat_vl"))


@VL_REFERENCE
def test_chat_messages_with_image_parts_and_the_cli_equal_transformers(
        chat_vl, make_engine, tmp_path, capsys):
    """A user message of image parts and text: the template's vision tokens, the image
    token expanded to the image's count, the text kept plain; greedy tokens equal
    transformers' generate on those ids; `flash-planner generate --chat --image` the same."""
    import json

    from PIL import Image

    from flash_planner.cli import main
    from flash_planner.engine.generate import GenerationSettings, encode_prompt, generate
    from flash_planner.engine.inputs.images import to_patches

    path, pad = chat_vl
    engine = make_engine(path, prefill_chunk=8)
    pixels = np.random.default_rng(5).integers(0, 256, (40, 24, 3), dtype=np.uint8)
    file = tmp_path / "frame.png"
    Image.fromarray(pixels).save(file)
    image = to_patches(Image.open(file), engine.vision.image_config)
    text = "put the <|image_pad|> cup left of the plate in the sink"   # specials stay text
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    rendered = engine.vision.expand(encode_prompt(engine, messages), [image])
    assert rendered.count(pad) == image.tokens          # the text's "<|image_pad|>" is not one
    start = engine.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert rendered[rendered.index(start) + 1:][:image.tokens] == [pad] * image.tokens
    n = 8
    got = generate(engine, messages, GenerationSettings(n, ignore_eos=True), images=[image])
    theirs = _transformers_model(path)
    with torch.no_grad():
        want = theirs.generate(
            input_ids=torch.tensor([rendered]), pixel_values=image.patches,
            image_grid_thw=torch.tensor([image.grid]),
            mm_token_type_ids=torch.tensor([[int(i == pad) for i in rendered]]),
            max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(rendered):].tolist()
    assert got.token_ids == want
    capsys.readouterr()
    assert main(["generate", "--model", str(path), "--chat", "--prompt", text, "--image",
                 str(file), "--max-new-tokens", str(n), "--ignore-eos", "--json",
                 "--device", "cpu", "--prefill-chunk", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    (tmp_path / "notes.txt").write_text("not an image")
    assert main(["generate", "--model", str(path), "--chat", "--prompt", text, "--image",
                 str(tmp_path / "notes.txt"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--image" in err and "not a readable image" in err


def test_the_cli_refuses_an_image_for_a_text_only_model(hybrid_dir, tmp_path, capsys):
    from PIL import Image

    from flash_planner.cli import main

    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "f.png")
    assert main(["generate", "--model", str(hybrid_dir), "--chat", "--prompt", "go",
                 "--image", str(tmp_path / "f.png"), "--device", "cpu"]) == 2
    assert "text-only model" in capsys.readouterr().err
