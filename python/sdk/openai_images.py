"""The official `openai` SDK against a diffmesh gateway, unchanged (tests/tests/openai_sdk.rs).

Usage: openai_images.py BASE_URL API_KEY MODEL. Runs images.generate (n=2, b64_json; then
n=2 at size auto as JPEG with output_compression, quality, background and user; WebP; then a
signed result URL, read without the key, and a tampered one), images.edit
with `image` and a mask in OpenAI's alpha convention, images.edit with `image=[...]` (sent as
`image[]`), images.create_variation (n=2), a streamed generation with two partial images (JPEG) and a streamed edit with
one, a generation of an invalid size (BadRequestError: its param, type and code), then
generations until the key's rate limit answers (RateLimitError). Prints one JSON line of what
it saw; any other exception fails the run.
"""
import base64
import io
import json
import sys
import urllib.error
import urllib.request

import openai
from PIL import Image


def png(image):
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def sizes(response):
    return [list(Image.open(io.BytesIO(base64.b64decode(d.b64_json))).size) for d in response.data]


def streamed(stream):
    """The events of a streamed answer: type, partial index, image format and size, usage."""
    events = []
    for event in stream:
        image = Image.open(io.BytesIO(base64.b64decode(event.b64_json)))
        seen = {"type": event.type, "format": image.format, "size": list(image.size)}
        if "partial_image" in event.type:
            seen["index"] = event.partial_image_index
        else:
            seen["output_tokens"] = event.usage.output_tokens
        events.append(seen)
    return events


def main():
    base, key, model = sys.argv[1:4]
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    seen = {"sdk": openai.__version__}
    r = client.images.generate(model=model, prompt="a red square", n=2, size="64x64",
                               response_format="b64_json")
    seen["generate"] = sizes(r)
    seen["usage"] = r.usage.model_dump(exclude_none=True) if r.usage else None
    r = client.images.generate(model=model, prompt="a red square", n=2, size="auto",
                               output_format="jpeg", output_compression=80, quality="low",
                               background="opaque", user="user-1")
    seen["generate_jpeg"] = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))).format
                             for d in r.data]
    r = client.images.generate(model=model, prompt="a red square", output_format="webp")
    seen["generate_webp"] = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))).format
                             for d in r.data]
    r = client.images.generate(model=model, prompt="a red square", response_format="url")
    url = r.data[0].url
    # A signed URL opens without the API key; a tampered one does not.
    with urllib.request.urlopen(url) as answer:
        seen["url"] = {"content_type": answer.headers["content-type"],
                       "size": list(Image.open(io.BytesIO(answer.read())).size)}
    try:
        urllib.request.urlopen(url.replace("signature=", "signature=A"))
        seen["url"]["tampered"] = 200
    except urllib.error.HTTPError as e:
        seen["url"]["tampered"] = e.code
    template = png(Image.new("RGB", (64, 64), (120, 30, 200)))
    # OpenAI's convention: where the mask is transparent, the image is edited.
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (16, 16, 48, 48))
    r = client.images.edit(model=model, image=("t.png", template, "image/png"),
                           mask=("m.png", png(mask), "image/png"), prompt="a cat")
    seen["edit"] = sizes(r)
    r = client.images.edit(model=model, image=[("t.png", template, "image/png")],
                           mask=("m.png", png(mask), "image/png"), prompt="a cat")
    seen["edit_list"] = sizes(r)
    r = client.images.create_variation(model=model, image=("t.png", template, "image/png"), n=2)
    seen["variation"] = sizes(r)
    stream = client.images.generate(model=model, prompt="a red square", size="64x64",
                                    stream=True, partial_images=2, output_format="jpeg")
    seen["stream"] = streamed(stream)
    stream = client.images.edit(model=model, image=("t.png", template, "image/png"),
                                mask=("m.png", png(mask), "image/png"), prompt="a cat",
                                stream=True, partial_images=1)
    seen["stream_edit"] = streamed(stream)
    try:
        client.images.generate(model=model, prompt="a cat", size="big")
        seen["bad_size"] = None
    except openai.BadRequestError as e:
        seen["bad_size"] = {"status": e.status_code, "param": e.param, "type": e.type, "code": e.code}
    for _ in range(8):
        try:
            client.images.generate(model=model, prompt="a cat", size="64x64")
        except openai.RateLimitError as e:
            seen["rate_limited"] = {"status": e.status_code, "type": e.type, "code": e.code}
            break
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
