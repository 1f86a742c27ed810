"""Images: JPEG headers, crop plans, fused decoding, torchvision-style transforms, ImageFolder.

``images.py`` (files to 8-bit RGB, the same way when packing and reading), ``image_limits.py``
(limits checked from a header before any decoder allocates), ``transforms.py`` (torchvision's
names and semantics; the crop box is drawn here), ``decoding.py`` (NOTE [ Fused decoding ]:
decode only what the first crop keeps), ``folder.py`` (ImageFolder).

May import: ``device``, ``formats``; never ``datasets``, ``packing``, ``sampling`` or ``loader``.
"""
