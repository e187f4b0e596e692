// Package oippb is the Open Inference Protocol's gRPC service (the KServe
// v2 protocol, with Triton's ModelStreamInfer for decoupled models),
// generated from grpc_service.proto by scripts/gen-proto.sh. Field names and
// numbers are the published protocol's, so Triton's and MLServer's own
// stubs speak to it.
package oippb
