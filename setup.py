"""Packaging of flash_planner as a ROS 2 ament_python package (also pip-installable).

The Triton kernels live inside the package (``flash_planner/kernels/``) and ship as
``flash_planner.kernels``; there must never be a top-level ``kernels`` package (Hugging Face
ships one of that name and transformers probes for it).
"""

from glob import glob

from setuptools import find_packages, setup

PACKAGE = "flash_planner"

setup(
    name=PACKAGE,
    version="0.1.0",
    description="On-robot LLM task planner with DFlash speculative decoding",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    package_data={PACKAGE: ["assets/**/*"]},
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", sorted(glob("launch/*.launch.py"))),
        (f"share/{PACKAGE}/config", sorted(glob("config/*.yaml"))),
        (f"share/{PACKAGE}/config/models", sorted(glob("config/models/*.yaml"))),
    ],
    install_requires=[
        "torch",
        "triton",
        "transformers>=5.2",
        "safetensors",
        "tokenizers",
        "pyyaml",
        "jsonschema",
        "xgrammar>=0.2.8",
        "numpy",
        "huggingface_hub",
    ],
    # compressed-tensors writes the tests' compressed-tensors checkpoints (its own packing);
    # gguf reads the real Qwen vocabulary out of llama.cpp's GGUF file (train/qwen_vocab.py)
    # serve: `flash-planner serve` (FastAPI + uvicorn, Prometheus metrics); openai: the
    # official client the server's tests talk through; vision: images decoded and resized
    # by Pillow (engine/inputs/images.py), the image processor's own resampling; mcp: the
    # official MCP SDK `flash-planner mcp` is built on (server/mcp_server.py); hypothesis:
    # the safety gate's property suite (test/planning/test_gate_properties.py); behaviortreepy:
    # BehaviorTree.CPP v4 itself, loading and ticking our exported trees, and lxml: the
    # catalog's XSD that BT XML trees are read against (test/planning/test_bt.py);
    # ml_dtypes (onnx needs it) below 0.7: xgrammar's tvm_ffi imports it whenever it is
    # installed, and 0.7.0 takes 0.6 s to import against 0.01-0.1 s for 0.5.4-0.6.0
    extras_require={"test": ["pytest", "pytest-xdist", "onnx", "onnxruntime", "onnxscript",
                             "ruff", "compressed-tensors>=0.20", "gguf>=0.10", "openai",
                             "fastapi", "uvicorn", "prometheus_client", "pillow",
                             "mcp>=2.3,<3", "hypothesis>=6.100", "behaviortreepy>=0.1.4",
                             "lxml", "ml_dtypes>=0.5.4,<0.7"],
                    "serve": ["fastapi", "uvicorn", "prometheus_client"],
                    "mcp": ["mcp>=2.3,<3"],
                    # BehaviorTree.CPP XML trees read against the catalog's schema (bt.py)
                    "bt": ["lxml"],
                    "vision": ["pillow"],
                    "bench": ["matplotlib", "gguf>=0.10"]},
    zip_safe=False,
    entry_points={
        "console_scripts": [
            "flash-planner = flash_planner.cli:main",
            "planner_node = flash_planner.ros.node:main",
            "planner_mcp = flash_planner.ros.mcp_door:main",
        ],
    },
)
