"""Vision-language models (mlx-vlm) with a store underneath: images in prompts
are keyed by their content, so prompts share everything before their first
differing image, and a hit past every image never runs the vision tower.

Needs mlx-vlm: `pip install 'promptstore[vision]'`.
"""

from .generation import generate, stream_generate
from .images import ImageLimits, load_image
from .keys import ImageSpan, image_digest, span_key
from .model import VisionModel, VisionPrompt

__all__ = [
    "ImageLimits",
    "ImageSpan",
    "VisionModel",
    "VisionPrompt",
    "generate",
    "image_digest",
    "load_image",
    "span_key",
    "stream_generate",
]
