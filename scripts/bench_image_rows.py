"""The cost of a row with images against a text row of the same length, through one image-text target.

    python scripts/bench_image_rows.py                     # tiny random Qwen3-VL, ../shared/data/vision rows
    python scripts/bench_image_rows.py --copies 16 --repeats 3 --json image_rows.json

The image rows are ``../shared/data/vision/mllm_demo.json`` (LLaMA-Factory form: ``<image>``
placeholders, the demo's three JPEGs), ``--copies`` times. The text rows have the same number of
rows, each as many tokens as its image row once the processor has expanded the images (a user turn
of filler words, matched to the token). Both runs capture through the same checkpoint
(``write/target/tiny.py``'s Qwen3-VL layout: a 2-block vision tower beside a 4-layer language model,
so the figure says what the image path adds here, not what a 4B vision tower costs on a GPU).
Each repeat runs both, alternating which goes first; medians of the run's own timings are reported:
tokenizing (for image rows: reading, hashing and resizing the images, the processor's expansion)
and the forward (for image rows: the pixels through the vision tower, batched like the text rows).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import REPO, log

VISION = REPO.parent / "shared" / "data" / "vision"


def image_rows(dst: Path, copies: int) -> Path:
    rows = json.loads((VISION / "mllm_demo.json").read_text())
    for r in rows:
        r["images"] = [str(VISION / p) for p in r["images"]]
    path = dst / "image_rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for _ in range(copies) for r in rows))
    return path


def text_rows(dst: Path, images: Path, lengths: list[int], tokenizer: object) -> Path:
    """One text row per image row, the answers kept, the user turns filler words: as many tokens as ``lengths``."""
    from dspark_precompute.write.samples.images import IMAGE_PLACEHOLDER

    out = []
    for line, want in zip(images.read_text().splitlines(), lengths, strict=True):
        row = json.loads(line)
        msgs = [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, "")} for m in row["messages"]]
        head = msgs[0]["content"]
        lo, hi = 0, max(1, want)
        while lo < hi:  # the most filler words that keep the row within ``want`` tokens
            mid = (lo + hi + 1) // 2
            msgs[0] = {**msgs[0], "content": head + " word" * mid}
            lo, hi = (mid, hi) if _tokens(tokenizer, msgs) <= want else (lo, mid - 1)
        msgs[0] = {**msgs[0], "content": head + " word" * lo}
        out.append({"messages": msgs})
    path = dst / "text_rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def _tokens(tokenizer: object, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False)  # type: ignore[attr-defined]
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def capture(model: Path, data: Path, cache: Path) -> dict[str, float]:
    from dspark_precompute.write.run import run

    t0 = time.perf_counter()
    result = run(benchlib.compose([f"model.path={model}", f"data.path={data}", f"storage.path={cache}",
                                   "overwrite=true", "seq_length=4096", "progress=false", "log_level=WARNING"]))
    return {"wall_s": time.perf_counter() - t0, "tokenize_s": result.timing.get("tokenize_s", 0.0),
            "forward_s": result.timing.get("forward_s", 0.0), "samples": result.samples,
            "tokens": result.tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=8, help="copies of the 6 demo rows")
    ap.add_argument("--repeats", type=int, default=3)
    benchlib.output_args(ap)
    args = ap.parse_args()
    if not (VISION / "mllm_demo.json").is_file():
        raise SystemExit(f"{VISION} is absent: this benchmark reads the shared vision rows")
    from transformers import AutoTokenizer

    from dspark_precompute.read.reader import CacheReader
    from dspark_precompute.write.target.tiny import save_image_text_checkpoint

    work = Path(tempfile.mkdtemp(prefix="dspark_bench_image_rows_"))
    model = work / "tiny_qwen3_vl"
    save_image_text_checkpoint("qwen3_vl", model)
    img = image_rows(work, args.copies)
    capture(model, img, work / "img")
    lengths = [int(n) for n in CacheReader(work / "img").lengths()]
    txt = text_rows(work, img, lengths, AutoTokenizer.from_pretrained(model))
    runs: dict[str, list[dict[str, float]]] = {"image": [], "text": []}
    for rep in range(args.repeats):
        for kind in benchlib.rotated(["image", "text"], rep):
            runs[kind].append(capture(model, img if kind == "image" else txt, work / kind))
            log(f"repeat {rep + 1}: {kind} rows {runs[kind][-1]}")
    med = {k: {m: benchlib.median([r[m] for r in v]) for m in v[0]} for k, v in runs.items()}
    rows = []
    for m in ("tokenize_s", "forward_s", "wall_s"):
        per = {k: med[k][m] / med[k]["samples"] * 1e3 for k in med}
        rows.append([m.removesuffix("_s"), f"{per['text']:.2f}", f"{per['image']:.2f}",
                     f"{per['image'] / per['text']:.2f}x" if per["text"] else "-"])
    md = (f"{med['image']['samples']:.0f} rows each; {med['image']['tokens']:,.0f} tokens with the images expanded, "
          f"{med['text']['tokens']:,.0f} in the text rows; "
          f"{benchlib.cpu_model()}, load {benchlib.load_average()}; medians of {args.repeats} alternating repeats, "
          "ms per row:\n\n" + "\n".join(benchlib.md_table(["stage", "text row", "image row", "image / text"], rows)))
    log(md)
    benchlib.save(args, {"machine": benchlib.machine(), "median": med, "runs": runs}, md)


if __name__ == "__main__":
    main()
