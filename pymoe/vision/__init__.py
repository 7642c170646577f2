"""Images in: llama.cpp's mmproj files (mmproj.py), image preprocessing (preprocess.py), the vision encoder
(encoder.py). See docs/vision.md."""
