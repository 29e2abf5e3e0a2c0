"""`python -m engine.export fetch-converter [llama_cpp_python-X.tar.gz]`: put llama.cpp's
converter of the pinned llama-cpp-python in place (engine/export/gguf.py says why it is needed)."""

import sys

from engine.export.gguf import main

sys.exit(main())
