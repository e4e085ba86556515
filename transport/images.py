"""The image input contract: what a raw item's data may be and how it becomes uint8
``(H, W, C)`` pixels (the rules ``Producer.publish`` and ``preprocess_images`` share), and
the encoded formats that travel as they are for the owner to decode."""

from ._pixels import MAX_IMAGE_PIXELS as MAX_IMAGE_PIXELS
from ._pixels import AlphaRule as AlphaRule
from ._pixels import encoded_image as encoded_image
from ._pixels import image_size as image_size
from ._pixels import keeps_alpha as keeps_alpha
from ._pixels import pixel_shape as pixel_shape
from ._pixels import pixels_into as pixels_into
from ._pixels import to_pixels as to_pixels
from ._schema import ENCODED_FORMATS as ENCODED_FORMATS

__all__ = [
    "ENCODED_FORMATS",
    "MAX_IMAGE_PIXELS",
    "AlphaRule",
    "encoded_image",
    "image_size",
    "keeps_alpha",
    "pixel_shape",
    "pixels_into",
    "to_pixels",
]
