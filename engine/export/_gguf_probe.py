"""Load a GGUF with llama.cpp and run what the self-check will run, in a child process:
`python _gguf_probe.py GGUF N_CTX N_THREADS IDS_JSON PROMPT_IDS_JSON`.

llama.cpp stops the whole process when one of its asserts fails (GGML_ASSERT -> abort). The
self-check then loads the GGUF in the exporting process, which in the studio is the window:
a GGUF llama.cpp cannot run would take the window down with it. Seen with a Llama-4 text model,
which llama.cpp 0.3.36 converts and loads but aborts on in its first decode ("tensor buffer not
set"). So engine/export/gguf.py runs this first: the same load (the same parameters, plain CPU
buffers), one scored evaluation and a few greedy tokens. A non-zero exit is the self-check's
failure, with llama.cpp's last line as the reason; zero means the in-process check may go on.

Run by path, like _gguf_convert.py; nothing here is imported by the engine.
"""

import json
import sys
from pathlib import Path


def main() -> int:
    path, n_ctx, n_threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ids, prompt_ids = json.loads(sys.argv[4]), json.loads(sys.argv[5])
    import llama_cpp

    from engine.export.gguf import load_for_check

    llm = load_for_check(llama_cpp, path, n_ctx, n_threads)
    try:
        if ids:
            llm.eval(ids)
        if prompt_ids:
            llm.reset()
            llm.create_completion(prompt=prompt_ids, max_tokens=4, temperature=0.0, top_k=1)
    finally:
        llm.close()
    print(f"probe: {Path(path).name} loads and runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
