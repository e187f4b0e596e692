"""Generated Open Inference Protocol stubs (scripts/gen-proto.sh); do not edit."""
