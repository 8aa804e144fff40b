"""Generated protobuf and gRPC stubs of opendsec.v1 (scripts/gen_protos.sh). Do not edit."""
