"""Tiered-cache benchmark on the ~30M-parameter hybrid checkpoint (CPU, fp32): the user's A/B/C experiment and the
tiers' copy bandwidth, each against its baseline.

1. TTFT of session A (a 3000-token prompt, max_tokens=1) with a device pool too small to keep A beside B and C:
   cold (cache off), device hit (A twice in a row), host hit (A after B and C, host tier on), file hit after a
   restart (a new Engine on the folder the first one wrote, host tier off, prefetch "wait_complete"); plus the
   control (device cache only: A after B and C is recomputed). Every hit must give the cold run's token.
2. Bandwidth: HostTier.save_pages / load_pages over many pages vs a plain dst.copy_(src) of the same bytes;
   FileTier write + flush and read_chain vs a plain sequential write (no fsync) and Path.read_bytes of the same
   bytes (both from and to the page cache: nothing here drops it; the plain read keeps what it read, as
   read_chain must). A breakdown of the file path's stages
   (tobytes, payload concatenation, CRC32, bytearray copy) shows where the time goes.

    python bench/tiers.py [--dir CACHE_DIR] [--page-size 16] [--reps 3] [--threads N]

Times are the best of --reps (a busy 2-core machine makes single runs jump by 10x and more).
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_checkpoint, fmt_table, make_prompts, engine_for  # noqa: E402

from tinyserve.blob import Blob, chain_hashes  # noqa: E402
from tinyserve.engine import Engine  # noqa: E402
from tinyserve.file_tier import FileTier  # noqa: E402
from tinyserve.host_tier import HostTier  # noqa: E402
from tinyserve.loader import load_model  # noqa: E402
from tinyserve.sampling import SamplingParams  # noqa: E402

FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)    # the request time is the TTFT
GB = 1e9


def ttft(engine: Engine, prompt: list[int]):
    t0 = time.perf_counter()
    (req,) = engine.run_requests([prompt], FIRST)
    return time.perf_counter() - t0, req


def best_of(fn, reps: int) -> float:
    """Smallest wall time of reps calls (bandwidth: the least disturbed run)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def tiers_str(req) -> str:
    t = req.report["cached_by_tier"]
    return f"dev {t.get('device', 0)} host {t.get('host', 0)} file {t.get('file', 0)}"


# ---------------------------------------------------------------- 1. the experiment
def experiment(model, ps: int, reps: int, rows: list) -> float:
    """The TTFT rows; returns the cold prefill speed (tokens/s of session A)."""
    kw = dict(engine=dict(page_size=ps, kv_cache_tokens=4000, max_running_requests=1, chunked_prefill_size=2048))
    a, b, c = (make_prompts(1, 3000, 3000, seed=s)[0] for s in (11, 12, 13))

    cold = engine_for(model, **kw, cache={"enabled": False})
    ttft(cold, a[:64])                                               # warm-up
    dt, r = ttft(cold, a)
    t_cold, ref = [dt], r.output_ids

    def cold_round() -> None:
        """Cold runs are spread between the hit measurements, so a busy spell cannot flatter the ratios."""
        dt, r = ttft(cold, a)
        assert r.output_ids == ref, "two cold runs disagree"
        t_cold.append(dt)

    results: list[tuple[str, list[float], object, str]] = []

    def row(name: str, times: list[float], req, target: str) -> None:
        results.append((name, times, req, target))
        cold_round()

    # device only (control): A after B and C is recomputed
    dev = engine_for(model, **kw)
    ttft(dev, a)
    t_dev, r_dev = [], None
    for _ in range(reps):
        dt, r_dev = ttft(dev, a)
        t_dev.append(dt)
    row("device hit (A, A)", t_dev, r_dev, "")
    t_ctl, r_ctl = [], None
    for _ in range(1):                                               # one round: it recomputes, as cold does
        ttft(dev, b)
        ttft(dev, c)
        dt, r_ctl = ttft(dev, a)
        t_ctl.append(dt)
    row("control: device only, A after B, C", t_ctl, r_ctl, "")
    del dev

    host = engine_for(model, **kw, cache={"host": {"size_gb": 1.0, "write_policy": "write_through"}})
    ttft(host, a)
    t_host, r_host = [], None
    for _ in range(reps):
        ttft(host, b)
        ttft(host, c)
        dt, r_host = ttft(host, a)
        t_host.append(dt)
    row("host hit (A after B, C)", t_host, r_host, "<= 0.05")
    del host

    with tempfile.TemporaryDirectory(prefix="tinyserve-bench-tiers-") as d:
        writer = engine_for(model, **kw, cache={"file": {"dir": d, "size_gb": 1.0}})
        ttft(writer, a)
        ttft(writer, b)
        ttft(writer, c)
        writer.close()                                         # the blobs are on disk now
        del writer
        t_file, r_file = [], None
        for _ in range(reps):                                        # each rep is a fresh "restart"
            reader = engine_for(model, **kw,
                                cache={"file": {"dir": d, "size_gb": 1.0, "prefetch_policy": "wait_complete"}})
            dt, r_file = ttft(reader, a)
            t_file.append(dt)
            reader.close()
            del reader
        row("file hit after restart", t_file, r_file, "<= 0.10")

    cold_s = min(t_cold)
    rows.append(("cold (cache off)", f"{cold_s * 1e3:.1f}", "1.000", "", "0", "-", "ref"))
    for name, times, req, target in results:
        best = min(times)
        same = "same" if req.output_ids == ref else f"DIFFERENT {req.output_ids} vs {ref}"
        rows.append((name, f"{best * 1e3:.1f}", f"{best / cold_s:.3f}", target, str(req.cached_tokens),
                     tiers_str(req), same))
    return len(a) / cold_s


# ---------------------------------------------------------------- 2. bandwidth
def host_bandwidth(model, ps: int, reps: int, rows: list) -> None:
    eng = engine_for(model, engine={"page_size": ps, "kv_cache_tokens": 4096 * ps, "max_running_requests": 1})
    pool = eng.kv_pool
    n = pool.num_pages
    host = HostTier(pool, eng.state_pool, num_pages=n, num_snapshots=0)
    pool.buffer.copy_(torch.randn_like(pool.buffer))
    dev_pages, host_pages = list(range(n)), host.alloc_pages(n)
    nbytes = n * pool.bytes_per_page
    t_save = best_of(lambda: host.save_pages(dev_pages, host_pages), reps)
    t_load = best_of(lambda: host.load_pages(host_pages, dev_pages), reps)
    assert torch.equal(host.kv[:n], pool.buffer[:n]), "host round trip changed the pages"
    src, dst = pool.buffer, torch.empty_like(pool.buffer)
    t_plain = best_of(lambda: dst.copy_(src), reps)
    # the same page set scattered (every other page): the general case of _copy_rows, same bytes / 2
    half = dev_pages[::2]
    t_scatter = best_of(lambda: host.save_pages(half, host_pages[:len(half)]), reps)
    plain = nbytes / t_plain
    rows.append(("host save_pages", f"{n} pages x {pool.bytes_per_page >> 10} KiB", f"{nbytes / t_save / GB:.2f}",
                 f"{plain / GB:.2f}", f"{nbytes / t_save / plain:.2f}", ">= 0.70"))
    rows.append(("host load_pages", "same", f"{nbytes / t_load / GB:.2f}", f"{plain / GB:.2f}",
                 f"{nbytes / t_load / plain:.2f}", ">= 0.70"))
    rows.append(("host save_pages, every other page", f"{len(half)} pages",
                 f"{nbytes / 2 / t_scatter / GB:.2f}", f"{plain / GB:.2f}", f"{nbytes / 2 / t_scatter / plain:.2f}",
                 ""))
    del eng, host


def file_bandwidth(model, ps: int, reps: int, rows: list, breakdown: list) -> tuple[float, float]:
    """The file rows; returns (blob bytes per cached token, read_chain bytes/s)."""
    eng = engine_for(model, engine={"page_size": ps, "kv_cache_tokens": 64 * ps, "max_running_requests": 1})
    page_shape = tuple(eng.kv_pool.buffer.shape[1:])
    conv_shape, ssm_shape = tuple(eng.state_pool.conv.shape[1:]), tuple(eng.state_pool.ssm.shape[1:])
    n_blobs, pages_per_blob = 24, 192                # ~ a 3000-token session per blob, with its snapshot
    tokens = make_prompts(1, n_blobs * pages_per_blob * ps + 1, n_blobs * pages_per_blob * ps + 1, seed=21)[0]
    fp = b"bench-tiers-fingerprint".ljust(32, b"\0")
    hashes = chain_hashes(fp, tokens[:n_blobs * pages_per_blob * ps], ps)
    g = torch.Generator().manual_seed(0)
    blobs = []
    for i in range(n_blobs):
        p0, p1 = i * pages_per_blob, (i + 1) * pages_per_blob
        blobs.append(Blob(hashes[p0], hashes[p1], tokens[p0 * ps:p1 * ps],
                          torch.randn((pages_per_blob,) + page_shape, generator=g),
                          torch.randn(conv_shape, generator=g), torch.randn(ssm_shape, generator=g)))

    with tempfile.TemporaryDirectory(prefix="tinyserve-bench-file-") as d:
        root = Path(d)

        def new_tier(k: int) -> FileTier:
            return FileTier(root / f"tier{k}", 8 << 30, fp, page_shape, torch.float32, conv_shape,
                            eng.state_pool.conv.dtype, ssm_shape)

        # write: a fresh folder per rep (an existing blob is skipped)
        t_w, tier = [], None
        for k in range(reps):
            tier = new_tier(k)
            t0 = time.perf_counter()
            for blob in blobs:
                tier.write(blob)
            ok = tier.flush(120.0)
            t_w.append(time.perf_counter() - t0)
            assert ok and tier.num_blobs == n_blobs, "file tier did not write every blob"
        nbytes = tier.used_bytes
        sizes = [e.size for dd in tier.index.by_start.values() for e in dd.values()]
        t_r, got = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            got = tier.read_chain(hashes, tokens, 0, ps)
            t_r.append(time.perf_counter() - t0)
        assert len(got) == n_blobs and all(torch.equal(x.kv, y.kv) for x, y in zip(got, blobs)), \
            "file tier read back other bytes"
        tier.close()

        # plain: the same number of bytes in files of the same sizes, sequential write (no fsync) and read
        plain_dir = root / "plain"
        plain_dir.mkdir()
        payloads = [bytes(s) for s in sizes]
        t_pw = []
        for k in range(reps):
            t0 = time.perf_counter()
            for i, data in enumerate(payloads):
                with open(plain_dir / f"{k}-{i}.bin", "wb") as f:
                    f.write(data)
            t_pw.append(time.perf_counter() - t0)
        files = sorted(plain_dir.glob(f"{reps - 1}-*.bin"))
        t_pr = best_of(lambda: [p.read_bytes() for p in files], reps)

        w, r, pw, pr = nbytes / min(t_w), nbytes / min(t_r), nbytes / min(t_pw), nbytes / t_pr
        desc = f"{n_blobs} blobs x {sizes[0] / 2**20:.1f} MiB"
        rows.append(("file write + flush", desc, f"{w / GB:.2f}", f"{pw / GB:.2f}", f"{w / pw:.2f}", ">= 0.70"))
        rows.append(("file read_chain", "same (plain: read_bytes, kept)", f"{r / GB:.2f}", f"{pr / GB:.2f}", f"{r / pr:.2f}", ">= 0.70"))

        # where the file path's time goes: each stage of encode / FileTier._read on one blob, as GB/s of the blob size
        blob, size = blobs[0], sizes[0]
        kv = blob.kv.contiguous().view(torch.uint8).numpy()
        tok = struct.pack(f"<{len(blob.tokens)}i", *blob.tokens)
        kvb = kv.tobytes()
        payload = tok + kvb + blob.conv.numpy().tobytes() + blob.ssm.numpy().tobytes()
        data = (root / "tier0").glob("*.tsb").__next__().read_bytes()
        stages = [
            ("tobytes() of kv/conv/ssm (write)", lambda: (kv.tobytes(), blob.conv.numpy().tobytes(),
                                                          blob.ssm.numpy().tobytes())),
            ("payload / header concatenation (write, 2x)", lambda: b"h" + (tok + kvb + b"" + b"")),
            ("zlib.crc32 of the payload (write and read)", lambda: zlib.crc32(payload)),
            ("file.write to the page cache (write)", lambda: (root / "one.bin").write_bytes(payload)),
            ("Path.read_bytes (read)", lambda: (root / "one.bin").read_bytes()),
            ("bytearray(payload slice) for frombuffer (read)", lambda: bytearray(memoryview(data)[4:])),
            ("struct.pack of the token ids (write)", lambda: struct.pack(f"<{len(blob.tokens)}i", *blob.tokens)),
        ]
        for name, fn in stages:
            t = best_of(fn, max(reps, 5))
            breakdown.append((name, f"{t * 1e3:.2f} ms", f"{size / t / GB:.2f}"))
    del eng
    return nbytes / (n_blobs * pages_per_blob * ps), r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(bench_checkpoint(args.dir), torch.float32)
    ps, reps = args.page_size, args.reps
    exp_rows: list = []
    prefill = experiment(model, ps, reps, exp_rows)
    bw_rows: list = []
    breakdown: list = []
    host_bandwidth(model, ps, reps, bw_rows)
    per_token, read = file_bandwidth(model, ps, reps, bw_rows, breakdown)

    print(f"tinyserve tiered cache, page size {ps}, ~30M hybrid checkpoint, CPU fp32, {torch.get_num_threads()} "
          f"threads; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; device pool 4000 tokens, "
          f"1 running request; sessions A, B, C of 3000 tokens; best of {reps} (control: 1 round)")
    print(fmt_table(exp_rows, ("TTFT of A", "ms", "x cold", "target", "cached", "cached_by_tier", "token")))
    print()
    print(f"tier bandwidth (best of {reps}; file numbers are page-cache, no fsync on either side)")
    print(fmt_table(bw_rows, ("path", "size", "GB/s", "plain GB/s", "ratio", "target")))
    print()
    print("file path breakdown, one blob")
    print(fmt_table(breakdown, ("stage", "time", "GB/s")))
    print()
    # a file hit beats recomputing when its blobs arrive faster than the prefill would compute them: the folder (a
    # network share) must read at least (blob bytes per token) x (cold prefill tokens/s)
    print(f"file-tier break-even: blobs hold {per_token / 1024:.1f} KiB per token and a cold prefill runs at "
          f"{prefill:.0f} tokens/s here, so a folder that reads faster than {per_token * prefill / 1e6:.1f} MB/s "
          f"beats recomputing; this folder read at {read / 1e6:.0f} MB/s ({read / (per_token * prefill):.1f}x)")
    if os.getloadavg()[0] > (os.cpu_count() or 1) and not os.environ.get("OMP_WAIT_POLICY"):
        print("note: the machine is busier than its core count; OpenMP's spinning barriers then slow every "
              "multi-threaded op many times over and the TTFT figures mean little. Rerun when idle, or with "
              "OMP_WAIT_POLICY=PASSIVE (or --threads 1).")


if __name__ == "__main__":
    main()
