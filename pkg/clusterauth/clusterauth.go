// Package clusterauth authenticates the head to its workers with a shared
// cluster token, for clusters whose head → worker link is not mutual TLS.
//
// Rules:
//   - The token comes from a file (--cluster-token-file) or the
//     environment (TROUPE_CLUSTER_TOKEN), never from argv, and has at
//     least MinTokenLen bytes.
//   - The worker checks it on every RPC, unary and stream, with a
//     constant-time compare; a missing or wrong token is Unauthenticated.
//     Only the standard grpc.health.v1 service is open, so that probes
//     (`troupe healthcheck grpc://…`) need no secret; it reveals
//     SERVING or NOT_SERVING and nothing else.
//   - The head sends it as per-RPC credentials, "authorization: Bearer
//     <token>" on every call.
package clusterauth

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// EnvVar is the environment variable that holds the token when no file is
// named.
const EnvVar = "TROUPE_CLUSTER_TOKEN"

// MinTokenLen is the shortest token accepted: 16 bytes, as `troupe certs`
// writes 32 random bytes in hex (64).
const MinTokenLen = 16

// openPrefix is the method prefix served without a token.
const openPrefix = "/grpc.health.v1.Health/"

// Load returns the token from file (trimmed of surrounding white space)
// when file is set, else from $TROUPE_CLUSTER_TOKEN; "" when neither is
// set. A token shorter than MinTokenLen is an error.
func Load(file string) (string, error) {
	var tok string
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return "", fmt.Errorf("clusterauth: read --cluster-token-file: %w", err)
		}
		tok = strings.TrimSpace(string(b))
		if tok == "" {
			return "", fmt.Errorf("clusterauth: --cluster-token-file %s is empty", file)
		}
	} else {
		tok = strings.TrimSpace(os.Getenv(EnvVar))
	}
	if tok != "" && len(tok) < MinTokenLen {
		return "", fmt.Errorf("clusterauth: the cluster token has %d bytes, want at least %d", len(tok), MinTokenLen)
	}
	return tok, nil
}

// NewToken returns a fresh random token (32 bytes, hex).
func NewToken() string {
	var b [32]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// errUnauthenticated is what a caller without the token gets.
var errUnauthenticated = status.Error(codes.Unauthenticated, "clusterauth: missing or wrong cluster token")

// checker compares the bearer token of incoming calls with the cluster's.
type checker struct{ want [sha256.Size]byte }

func (c checker) check(ctx context.Context, method string) error {
	if strings.HasPrefix(method, openPrefix) {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		scheme, tok, ok := strings.Cut(v, " ")
		if !ok || !strings.EqualFold(scheme, "Bearer") {
			continue
		}
		// Hashing first makes the compare constant-time in the length too.
		got := sha256.Sum256([]byte(strings.TrimSpace(tok)))
		if subtle.ConstantTimeCompare(got[:], c.want[:]) == 1 {
			return nil
		}
	}
	return errUnauthenticated
}

// ServerOptions are the interceptors that require token on every RPC but
// the grpc.health.v1 probes. They chain, so other interceptors still run
// (after the check).
func ServerOptions(token string) ([]grpc.ServerOption, error) {
	if len(token) < MinTokenLen {
		return nil, errors.New("clusterauth: token too short")
	}
	c := checker{want: sha256.Sum256([]byte(token))}
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			if err := c.check(ctx, info.FullMethod); err != nil {
				return nil, err
			}
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			if err := c.check(ss.Context(), info.FullMethod); err != nil {
				return err
			}
			return h(srv, ss)
		}),
	}, nil
}

// Credentials returns the per-RPC credentials that send token on every
// call. They do not require transport security: the token is the
// protection of a plaintext link, which is only as private as its network
// (docs/security.md).
func Credentials(token string) credentials.PerRPCCredentials { return bearer{"Bearer " + token} }

// DialOption is Credentials as a dial option.
func DialOption(token string) grpc.DialOption { return grpc.WithPerRPCCredentials(Credentials(token)) }

type bearer struct{ value string }

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": b.value}, nil
}

func (bearer) RequireTransportSecurity() bool { return false }
