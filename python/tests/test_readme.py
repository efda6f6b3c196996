"""The README's Python example runs and selects what the synchronous replicated selection selects."""

import os
import re

import numpy as np
import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


@pytest.mark.skipif(not os.path.exists(README), reason="README.md is not in this checkout")
def test_readme_example(capsys):
    text = open(README).read()
    block = re.search(r"## Python\n.*?```python\n(.*?)```", text, re.S).group(1)
    env = {}
    exec(compile(block, "README.md", "exec"), env)
    import indexcp as ic

    got = np.concatenate(env["out"], axis=1)
    layout = ic.make_page_layout(ic.KvDtype.nvfp4, 128, 1)
    cache = np.zeros(ic.view_bytes(layout, 32), np.uint8)
    view = ic.make_cache_view(layout, cache, 32)
    ic.insert_keys(view, 0, env["keys"], env["slots"])
    rep = np.zeros((1, 4, 16), np.int32)
    ic.decode_select(view, 0, env["q"], env["bt"], env["seq"], 1, 0, 4, ic.SelectionParams(), ic.KRounding.e4m3, rep)
    np.testing.assert_array_equal(got, rep)
    assert (rep >= 0).all() and "31" in capsys.readouterr().out
