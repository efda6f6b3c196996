"""Through the package, on the embedded real data: the recall against fp32 keys of the rows that
`indexcp run` reports equals the command's recorded recall (docs/cli.md's table), for nvfp4 and fp8."""

import os
import re
import sys

import pytest

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
DATA = os.path.join(REPO, "data", "minilm_stdlib")
CLI_DOC = os.path.join(REPO, "docs", "cli.md")


@pytest.mark.skipif(not (os.path.exists(os.path.join(DATA, "keys.npy")) and os.path.exists(CLI_DOC)),
                    reason="the real data or docs/cli.md is not in this checkout")
@pytest.mark.parametrize("dtype", ["nvfp4", "fp8"])
def test_recall_equals_the_commands(dtype):
    sys.path.insert(0, os.path.join(REPO, "examples", "python"))
    import real_data_recall

    recorded = re.search(r"^%s\s+128\s+2\s+off\s+\d+\s+yes\s+([0-9.]+)" % dtype, open(CLI_DOC).read(), re.M)
    assert recorded, "docs/cli.md has no row for " + dtype
    assert f"{real_data_recall.main(dtype, DATA):.4f}" == recorded.group(1)
