"""Every Python example in README.md runs, top to bottom, in one namespace."""

import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python examples"
    namespace: dict = {}
    for index, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {index}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(
                f"README python block {index} failed:\n{block}"
            ) from error
