# atomctl on an NVIDIA GPU. Build: docker build -t atomctl .
# Run:   docker run --gpus all -p 8000:8000 -v /models:/models atomctl --model /models/MyModel --host 0.0.0.0
# devel, not runtime: Triton compiles a small C launcher per kernel and needs gcc.
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-devel

WORKDIR /opt/atomctl
COPY pyproject.toml README.md ./
COPY atom_core ./atom_core
COPY atomctl ./atomctl
RUN pip install --no-cache-dir .

EXPOSE 8000
ENTRYPOINT ["atomctl", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
