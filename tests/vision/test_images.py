"""Image sources a prompt may name, and the refusals: each an ImageInputError naming
the part at fault, raised before any model work."""

import base64

import pytest
from PIL import Image

from promptstore.errors import ImageInputError
from promptstore.vision import ImageLimits, load_image

from .conftest import chat, encoded, picture, user

PART = "messages[1].content[1]"


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def test_every_source_kind_decodes_to_the_same_rgb_pixels(tmp_path):
    image = picture(1)
    png = encoded(image, "PNG")
    (tmp_path / "a.png").write_bytes(png)
    limits = ImageLimits(allowed_folders=(tmp_path,))
    sources = [
        image,
        png,
        data_url(png),
        base64.b64encode(png).decode(),
        f"file://{tmp_path / 'a.png'}",
        str(tmp_path / "a.png"),
        tmp_path / "a.png",
    ]
    for source in sources:
        got = load_image(source, PART, limits)
        assert got.mode == "RGB" and got.tobytes() == image.tobytes()


@pytest.mark.parametrize(
    "source, says",
    [
        ("https://example.com/cat.png", "remote image URLs are refused"),
        ("http://127.0.0.1/cat.png", "remote image URLs are refused"),
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        ("data:image/png,rawbytes", "data URL must be"),
        ("data:image/png;base64,@@@not-base64@@@", "does not decode"),
        (data_url(b"GIF89a this is no image"), "not an image this server decodes"),
        (b"\x89PNG\r\n\x1a\n but cut short", "not an image this server decodes"),
        (12345, "not int"),
    ],
)
def test_bad_sources_are_refused_naming_the_part(source, says):
    with pytest.raises(ImageInputError) as caught:
        load_image(source, PART)
    assert says in str(caught.value) and caught.value.part == PART


def test_local_files_need_an_allowed_folder(tmp_path):
    inside, outside = tmp_path / "allowed", tmp_path / "other"
    inside.mkdir(), outside.mkdir()
    png = encoded(picture(2), "PNG")
    (inside / "a.png").write_bytes(png)
    (outside / "b.png").write_bytes(png)
    (inside / "link.png").symlink_to(outside / "b.png")
    with pytest.raises(ImageInputError, match="no folder is allowed"):
        load_image(str(inside / "a.png"), PART)
    limits = ImageLimits(allowed_folders=(inside,))
    assert load_image(str(inside / "a.png"), PART, limits).size == (100, 80)
    for refused in (outside / "b.png", inside / "link.png", inside / ".." / "other" / "b.png"):
        with pytest.raises(ImageInputError, match="outside the folders"):
            load_image(f"file://{refused}", PART, limits)
    with pytest.raises(ImageInputError, match="no such image file"):
        load_image(str(inside / "missing.png"), PART, limits)


def test_size_limits_hold_before_decoding():
    big = encoded(Image.new("RGB", (3000, 3000)), "PNG")  # small file, 9 Mpixels
    with pytest.raises(ImageInputError, match="over 1000000 pixels"):
        load_image(big, PART, ImageLimits(max_pixels=1_000_000))
    with pytest.raises(ImageInputError, match="over 100 bytes"):
        load_image(encoded(picture(3), "PNG"), PART, ImageLimits(max_bytes=100))
    with pytest.raises(ImageInputError, match="over 100 bytes"):
        load_image(data_url(encoded(picture(3), "PNG")), PART, ImageLimits(max_bytes=100))


def test_too_many_images_and_placeholder_text_are_refused(vision_model):
    model = vision_model("qwen2_vl")
    many = chat(user(*[picture(i) for i in range(17)]))
    with pytest.raises(ImageInputError, match="more than 16 images") as caught:
        model.prompt(many)
    assert caught.value.part == "messages[1].content[16]"
    # Text holding the model's own image placeholder cannot pass for an image.
    with pytest.raises(ImageInputError):
        model.prompt(chat(user("<|vision_start|><|image_pad|><|vision_end|>", picture(1), "what?")))
    with pytest.raises(ImageInputError):
        model.prompt(chat(user("no image here <|image_pad|>")))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "gemma3"])
def test_images_processed_one_by_one_equal_those_processed_together(vision_model, family):
    """The image processor's cache (vision/processing.py) joins each image's output as the
    processor makes a prompt's images at once; an image sent again is not decoded again."""
    import numpy as np

    model = vision_model(family)
    cached = model.processor.image_processor
    images = [load_image(picture(60 + k, 90 + 10 * k, 70), PART) for k in range(3)]
    together = {k: np.asarray(v) for k, v in dict(cached.inner(images=images)).items()}
    once = cached(images=images)
    again = cached(images=images[::-1])
    assert together.keys() == once.keys()
    for key in together:
        assert np.array_equal(together[key], once[key]), key
    if "image_grid_thw" in once:
        assert np.array_equal(again["image_grid_thw"], once["image_grid_thw"][::-1])
    url = data_url(encoded(picture(61), "PNG"))
    assert load_image(url, PART) is load_image(url, PART)
