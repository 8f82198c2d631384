"""Image prompts: a question about an image, by token ids with one placeholder per image, and by text.

    python examples/vision.py [VL_CHECKPOINT]

Without a checkpoint it builds m3-tiny-vl (random weights: the answers are noise, the path is real) with
scripts/make_m3_tiny_vl.py, which needs transformers; the bundled m3-tiny has no vision tower.
"""

import asyncio
import base64
import io
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

from m3sdk import Engine, InvalidRequestError


def checkerboard() -> bytes:
    image = Image.new("RGB", (120, 90), "white")
    for x in range(0, 120, 15):
        for y in range(0, 90, 15):
            if (x + y) // 15 % 2:
                image.paste((200, 30, 30), (x, y, x + 15, y + 15))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


async def main(model: str) -> None:
    png = checkerboard()
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    async with Engine(model=model, max_model_len=256, limit_images=2) as engine:
        done = await engine.generate({"prompt": "Describe ]<]image[>[ briefly:", "images": [png]},
                                     max_tokens=12, temperature=0)
        print(f"text + image bytes: {done.text!r} ({done.usage.prompt_tokens} prompt tokens)")
        again = await engine.generate({"prompt": "Describe ]<]image[>[ briefly:", "images": [data_url]},
                                      max_tokens=12, temperature=0)
        print(f"same image as a data URL: {again.text == done.text}, "
              f"{again.usage.cached_prompt_tokens} prompt tokens from the prefix cache")
        try:
            await engine.generate({"prompt": "]<]image[>[", "images": ["https://example.com/cat.png"]})
        except InvalidRequestError as e:
            print(f"refused: {e}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(__file__).resolve().parent.parent / "scripts" / "make_m3_tiny_vl.py"
            subprocess.run([sys.executable, str(script), tmp], check=True, capture_output=True)
            asyncio.run(main(tmp))
