"""Object storage: a cache written to, resumed in and read from an S3 bucket.

The bucket lives in moto's S3 server, started here on 127.0.0.1 at a free port and
stopped at the end; the pipeline, its spawned writer process and a killed CLI run all
reach it over HTTP through s3fs, with the endpoint and (fake) credentials taken from
the environment exactly as on a real cluster.

The progress line (``progress.py``: tokens/s, ETA, bytes) is checked here too.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import moto.server as moto_server  # s3fs and moto[server] are in the [test] extra: a missing one fails, never skips
import numpy as np
import pytest
import s3fs
import torch
from helpers import compose

from dspark_precompute import open_cache
from dspark_precompute.contract import spec as fmt
from dspark_precompute.contract.commits import parse_commit_key
from dspark_precompute.contract.store import CacheStore, storage_options
from dspark_precompute.errors import MissingChunkError
from dspark_precompute.write.run import run

SECRET = "s3cr3t-" + uuid.uuid4().hex  # must never show up in a log, a repr or the cache


def tiny_run(path: str, *extra: str) -> list[str]:
    """Overrides for a few-second run with several units (8 rows, 128-token chunks, 2 chunks a unit)."""
    return [f"storage.path={path}", "seq_length=256", "batch.max_tokens=1024", "data.max_samples=8",
            "storage.chunk_tokens=128", "storage.unit_tokens=256", "progress=false", "log_level=WARNING",
            *extra]


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1 (free port); AWS_* variables point everything at it."""
    mp = pytest.MonkeyPatch()
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3",
                "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "DSPARK_STORAGE_OPTIONS", "DSPARK_FAULT"):
        mp.delenv(var, raising=False)
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_CONFIG_FILE", os.devnull)
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    mp.setenv("NO_PROXY", no_proxy)
    mp.setenv("no_proxy", no_proxy)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        mp.setenv("AWS_ENDPOINT_URL", endpoint)
        yield endpoint
    finally:
        server.stop()
        mp.undo()


@pytest.fixture
def bucket(s3_endpoint):
    """A fresh, empty bucket for one test."""
    name = f"dspark-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir(name)
    return name


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory):
    """The same tiny run written to a local directory: what every S3 cache must equal."""
    path = tmp_path_factory.mktemp("s3_ref") / "cache"
    run(compose(tiny_run(str(path))))
    return str(path)


def copy_to_bucket(local: str, bucket: str) -> tuple[str, CacheStore]:
    """A finished local cache copied file by file into ``s3://bucket/copy``: its URL and store."""
    url = f"s3://{bucket}/copy"
    remote = CacheStore(url)
    for f in Path(local).rglob("*"):
        if f.is_file() and not f.name.startswith("."):
            remote.write_bytes(f.relative_to(local).as_posix(), f.read_bytes())
    return url, remote


def every_array(cache) -> dict[str, np.ndarray]:
    """Every zarr array of an open cache, through the reader's own group."""
    out: dict[str, np.ndarray] = {}

    def walk(group, prefix=""):
        for name, arr in group.arrays():
            out[prefix + name] = np.asarray(arr[:])
        for name, sub in group.groups():
            walk(sub, f"{prefix}{name}/")
    walk(cache.group)
    return out


def assert_same_through_the_reader(url: str, local: str) -> None:
    """Bit-identical arrays, samples, weights, rejects and commit records; the same manifest identity."""
    a, b = open_cache(url), open_cache(local)
    assert a.complete and b.complete and len(a) == len(b) > 0
    xa, xb = every_array(a), every_array(b)
    assert xa and sorted(xa) == sorted(xb)
    for name in xa:
        assert xa[name].dtype == xb[name].dtype and np.array_equal(xa[name], xb[name]), name
    for i in range(len(b)):
        ra, rb = a.read_raw(i), b.read_raw(i)
        assert sorted(ra) == sorted(rb)
        for k in rb:
            assert np.array_equal(ra[k], rb[k]), (i, k)
    sa, sb = a.store, b.store
    for key in (fmt.WEIGHTS, fmt.REJECTS):
        assert sa.read_bytes(key) == sb.read_bytes(key), key
    assert sa.list_keys(fmt.COMMITS) == sb.list_keys(fmt.COMMITS)
    for key in sb.list_keys(fmt.COMMITS):
        assert json.loads(sa.read_bytes(key)) == json.loads(sb.read_bytes(key)), key
    for k in ("config_hash", "identity", "counts", "layout", "arrays", "layer_ids", "complete"):
        assert a.manifest.to_json()[k] == b.manifest.to_json()[k], k
    assert a.manifest.to_json()["config"]["storage"]["path"] == url


def test_the_fsspec_branch_of_the_store_behaves_like_a_directory(bucket, tmp_path):
    url = f"s3://{bucket}/cache"
    remote, local, sibling = CacheStore(url), CacheStore(tmp_path / "cache"), CacheStore(f"{url}2")
    assert remote.url and remote.root == f"{bucket}/cache"
    for s in (remote, local):
        assert s.is_empty() and not s.exists() and s.nbytes() == 0 and s.list_keys(fmt.COMMITS) == []
        s.write_bytes("manifest.json", b"{}")
        s.write_bytes("commits/u00001.json", b"12")
        s.write_bytes("commits/u00000.json", b"1")
        s.write_bytes("commits2/x", b"123")
        s.write_bytes("commits/u00000.json", b"abcd")  # overwrite in place
    sibling.write_bytes("commits/u00009.json", b"not ours")
    for s in (remote, local):
        assert not s.is_empty() and s.exists() and s.exists("commits") and s.exists("manifest.json")
        assert not s.exists("nope.json")
        assert s.list_keys("commits") == ["commits/u00000.json", "commits/u00001.json"]
        assert s.read_bytes("commits/u00000.json") == b"abcd" and s.nbytes() == 2 + 2 + 4 + 3
        s.delete("commits")
        s.delete("never-written")
        assert s.list_keys("commits") == [] and s.exists("commits2/x")
        s.remove_all()
        assert s.is_empty() and s.nbytes() == 0
    assert sibling.list_keys("commits") == ["commits/u00009.json"], "a sibling prefix was touched"
    with pytest.raises(FileNotFoundError):
        remote.read_bytes("manifest.json")

    top = CacheStore(f"s3://{bucket}")  # a cache at the bucket's top level: remove_all keeps the bucket
    top.write_bytes("a.json", b"1")
    top.remove_all()
    assert top.is_empty() and top.fs.exists(bucket)

    import zarr

    zs = remote.zarr_store()
    assert isinstance(zs, zarr.storage.FsspecStore) and zs.fs.async_impl and zs.fs.asynchronous
    g = zarr.create_group(zs, attributes={"k": 1})
    g.create_array("x", shape=(10,), chunks=(4,), dtype="int32")[:] = np.arange(10)
    ro = zarr.open_group(remote.zarr_store(read_only=True), mode="r")
    assert np.array_equal(ro["x"][:], np.arange(10)) and ro.attrs["k"] == 1
    assert remote.list_keys("x/c") == ["x/c/0", "x/c/1", "x/c/2"]


def test_options_come_from_the_environment_and_never_show(s3_endpoint, monkeypatch):
    opts = storage_options("s3://b/p")
    assert opts["endpoint_url"] == s3_endpoint and opts["use_listings_cache"] is False
    assert SECRET not in json.dumps(opts)  # credentials stay with botocore's own chain
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:9000")
    assert storage_options("s3://b/p")["endpoint_url"] == "http://s3-only:9000"
    assert storage_options("s3://b/p", {"endpoint_url": "http://given"})["endpoint_url"] == "http://given"
    monkeypatch.setenv("DSPARK_STORAGE_OPTIONS", json.dumps({"secret": SECRET, "requester_pays": True}))
    opts = storage_options("s3://b/p")
    assert opts["secret"] == SECRET and opts["requester_pays"] is True
    assert SECRET not in repr(CacheStore("s3://b/p"))
    monkeypatch.setenv("DSPARK_STORAGE_OPTIONS", '{"secret": "' + SECRET)  # broken JSON
    with pytest.raises(ValueError) as err:
        storage_options("s3://b/p")
    assert SECRET not in str(err.value)
    monkeypatch.delenv("DSPARK_STORAGE_OPTIONS")
    assert "endpoint_url" not in storage_options("gs://b/p", {})  # S3's variables only for S3


def test_a_run_into_a_bucket_reads_back_equal_to_the_same_run_on_disk(bucket, local_reference, caplog):
    url = f"s3://{bucket}/cache"
    with caplog.at_level(logging.DEBUG, logger="dspark_precompute"):
        result = run(compose(tiny_run(url)))
    assert result.path == url and result.units_written == open_cache(local_reference).num_units > 2
    assert result.bytes_on_disk == CacheStore(url).nbytes() > 0
    assert SECRET not in caplog.text
    assert_same_through_the_reader(url, local_reference)
    c, ref = open_cache(url), open_cache(local_reference)
    assert c.summary()["bytes_on_disk"] == result.bytes_on_disk and url in repr(c)
    assert c.summary()["token_bytes_on_disk"] == ref.summary()["token_bytes_on_disk"]
    again = run(compose(tiny_run(url)))  # complete: nothing to do
    assert again.units_written == 0
    assert_same_through_the_reader(url, local_reference)


@pytest.mark.slow  # moved out of the default lane to keep it under 10 minutes (CONTRIBUTING)
def test_a_killed_run_in_a_bucket_resumes_bit_identical(bucket, local_reference, tmp_path):
    url = f"s3://{bucket}/cache"
    # Killed after handing the 4th unit to the writer: with two unit buffers the forward loop
    # waited for two commits before it could fill the 3rd and 4th, so some units are committed.
    env = {**os.environ, "DSPARK_FAULT": "unit_submitted=4", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "dspark_precompute", *tiny_run(url)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert SECRET not in proc.stdout + proc.stderr
    store = CacheStore(url)
    manifest = json.loads(store.read_bytes(fmt.MANIFEST))
    assert manifest["complete"] is False
    committed = [k for k in store.list_keys(fmt.COMMITS) if parse_commit_key(k) is not None]  # not tokens.json
    assert 2 <= len(committed) < manifest["layout"]["num_units"]
    with pytest.raises(Exception, match="incomplete"):
        open_cache(url)
    partial = open_cache(url, allow_incomplete=True)
    assert len(partial) < partial.manifest.to_json()["counts"]["samples"]

    # one object per shard: each committed unit wrote exactly one object per hidden array, nothing else
    layer = partial.array_names[str(partial.layer_ids[0])]
    units = sorted(int(k.rsplit("u", 1)[1].split(".")[0]) for k in committed)
    shards = [k for k in store.list_keys(layer) if not k.endswith("zarr.json")]
    assert set(shards) >= {f"{layer}/c.{u}.0" for u in units}
    # Lose one committed unit as well, record and its shard object: the resume must rewrite it too.
    lost = units[0]
    shard_key = f"{layer}/c.{lost}.0"
    assert store.exists(shard_key)
    store.delete(shard_key)
    store.delete(committed[0])

    result = run(compose(tiny_run(url)))
    assert result.complete and result.resumed_units == len(committed) - 1
    assert result.units_written == manifest["layout"]["num_units"] - result.resumed_units
    assert_same_through_the_reader(url, local_reference)


def test_the_s3_storage_group_composes_with_the_storage_keys(s3_endpoint, monkeypatch):
    cfg = compose(["storage=s3"])
    assert cfg.storage.root.startswith("s3://") and cfg.storage.path is None
    from dspark_precompute.write.plan.prepare import default_storage_path

    assert default_storage_path(cfg).startswith(cfg.storage.root.rstrip("/") + "/")
    monkeypatch.setenv("DSPARK_S3_ROOT", "s3://my-bucket/team/caches")
    cfg = compose(["storage=s3", "seq_length=512"])
    assert cfg.storage.root == "s3://my-bucket/team/caches"
    assert default_storage_path(cfg).startswith("s3://my-bucket/team/caches/tiny-")
    local = compose([])
    for key in ("dtype", "compressor", "compression_level", "shuffle", "chunk_tokens", "unit_tokens", "unit_mib"):
        assert getattr(cfg.storage, key) == getattr(local.storage, key), key


def test_a_chunk_object_missing_from_a_bucket_is_a_missing_chunk_error_not_zeros(bucket, local_reference):

    from dspark_precompute.errors import MissingChunkError

    url, remote = copy_to_bucket(local_reference, bucket)
    ref = open_cache(local_reference)
    layer = ref.array_names[str(ref.layer_ids[0])]
    remote.delete(f"{layer}/c.0.0")  # unit 0's shard object
    c = open_cache(url)
    victims = [i for i in range(len(ref)) if int(ref.units()[i]) == 0]
    assert victims
    with pytest.raises(MissingChunkError, match=rf"array '{layer}' chunk \(\d+, 0\) \(in shard {layer}/c.0.0\) is "
                                                r"missing") as info:
        c.read_raw(victims[0])
    assert victims[0] in info.value.samples
    for i in sorted(set(range(len(ref))) - set(victims)):
        ra, rb = c.read_raw(i), ref.read_raw(i)
        assert all(np.array_equal(ra[k], rb[k]) for k in rb)


@pytest.mark.parametrize("shuffle", [True, "block"])
def test_the_loader_reads_a_bucket_ahead_into_the_same_batches_as_on_disk(bucket, local_reference, shuffle):
    """Two workers, each fetching the chunks of its next batches ahead within a byte and request bound."""
    from dspark_precompute.read.training import build_dataloader

    url, remote = copy_to_bucket(local_reference, bucket)
    kw = dict(batch_size=2, shuffle=shuffle, seed=3, block_chunks=1, window_blocks=2)
    local = list(build_dataloader(local_reference, **kw))
    for workers in (0, 2):
        loader = build_dataloader(url, num_workers=workers, prefetch_bytes=1 << 20, prefetch_requests=4, **kw)
        for _ in range(2):  # the same epoch twice: a second pass of the kept workers
            loader.set_epoch(0)
            got = list(loader)
            assert len(got) == len(local) > 2
            for a, b in zip(got, local, strict=True):
                assert all(torch.equal(a[k], b[k]) for k in b)
        if workers == 0:
            pf = loader.runner.prefetcher
            assert pf is not None and 0 < pf.peak_requests <= 4 and pf.peak_bytes <= 1 << 20 and pf.wasted == 0
    remote.delete(f"{open_cache(local_reference).array_names['last']}/c.0.0")
    with pytest.raises(MissingChunkError, match=r"chunk \(\d+, 0\) \(in shard [^)]*\) is missing"):
        list(build_dataloader(url, num_workers=2, **kw))


@pytest.mark.slow  # two CLI runs of 15 MB shards through moto: about two minutes here
def test_a_shard_larger_than_a_part_goes_up_in_parts_and_a_kill_mid_upload_leaves_no_object(bucket, tmp_path):
    """Shards stream up as a multipart upload (5 MiB parts here): a writer killed between parts leaves no
    object at all (the upload is never completed), and the same command then ends as a local run does."""
    wide = ("model.random.hidden_size=256", "model.random.head_dim=64", "data.max_samples=60", "seq_length=1024",
            "batch.max_tokens=4096", "storage.compressor=none", "storage.chunk_tokens=512",
            "storage.unit_tokens=65536")  # one unit; each hidden array's shard about 15 MB, uncompressed
    url = f"s3://{bucket}/big"
    local = tmp_path / "local"
    run(compose(tiny_run(str(local), *wide)))
    env = {**os.environ, "DSPARK_STORAGE_OPTIONS": json.dumps({"default_block_size": 5 << 20}),
           "DSPARK_FAULT": "shard_part=60", "PYTHONUNBUFFERED": "1"}  # a writer, one 5 MiB part up, the rest not
    proc = subprocess.run([sys.executable, "-m", "dspark_precompute", *tiny_run(url, *wide)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    store = CacheStore(url)
    layer = json.loads(store.read_bytes(fmt.MANIFEST))["arrays"]["1"]
    assert not store.exists(f"{layer}/c.0.0")  # half an upload is no object
    env.pop("DSPARK_FAULT")
    again = subprocess.run([sys.executable, "-m", "dspark_precompute", *tiny_run(url, *wide)], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert store.fs.size(f"{store.root}/{layer}/c.0.0") > 5 << 20  # more than one part
    assert_same_through_the_reader(url, str(local))


WORKERS_STOPPED_MID_EPOCH = """
import gc, logging, sys
from dspark_precompute.read.training import build_dataloader

def errors_to_stderr(_):
    # in a worker, asyncio's error log (where aiohttp reports unclosed sessions) goes to stderr, and what the
    # worker drops is collected at once, as a long-running worker's would be
    logging.getLogger("asyncio").addHandler(logging.StreamHandler(sys.__stderr__))
    gc.set_threshold(1, 1, 1)

loader = build_dataloader(sys.argv[1], batch_size=1, shuffle="block", seed=3, num_workers=2,
                          worker_init_fn=errors_to_stderr)
it = iter(loader)
assert all(next(it)["input_ids"].shape[0] == 1 for _ in range(3))
del it, loader  # a training loop that breaks out: the workers stop mid-epoch
gc.collect()
"""


def test_workers_stopped_mid_epoch_leave_the_parents_bucket_sessions_alone(bucket, local_reference, tmp_path):
    """A forked worker re-opens the cache; the handle it inherited is never collected there (collecting it dropped
    the parent's aiohttp sessions: "Unclosed client session" on stderr each time a worker stopped). A fresh
    training process: this one's earlier tests leave threads and sessions a fork would drop, unrelated to this."""
    url, _ = copy_to_bucket(local_reference, bucket)
    proc = subprocess.run([sys.executable, "-c", WORKERS_STOPPED_MID_EPOCH, url], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Unclosed client session" not in proc.stderr
