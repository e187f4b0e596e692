// Package tlsconfig builds the TLS configuration of troupe's gRPC links
// (head → worker) from the --tls-cert, --tls-key and --tls-ca flags.
//
// Server side: a certificate and key are required to serve TLS; adding a CA
// turns on mutual TLS: every client must present a certificate signed by it.
// Client side: the CA verifies the server (system roots when empty); a
// certificate and key, when given, are presented to the server. With no
// flags at all, both sides use plaintext.
package tlsconfig

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Files names the PEM files of one side of a link.
type Files struct {
	Cert string // certificate chain presented to the peer
	Key  string // private key of Cert
	CA   string // CA bundle that verifies the peer
}

// Enabled reports whether any TLS file is set.
func (f Files) Enabled() bool { return f.Cert != "" || f.Key != "" || f.CA != "" }

// Server returns the server configuration, or nil when no file is set.
func Server(f Files) (*tls.Config, error) {
	if !f.Enabled() {
		return nil, nil
	}
	if f.Cert == "" || f.Key == "" {
		return nil, errors.New("tlsconfig: a TLS server needs both --tls-cert and --tls-key")
	}
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return nil, fmt.Errorf("tlsconfig: load server key pair: %w", err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if f.CA != "" {
		pool, err := loadPool(f.CA)
		if err != nil {
			return nil, err
		}
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// Client returns the client configuration, or nil when no file is set.
// ServerName is left empty: gRPC fills it from the dialled address.
func Client(f Files) (*tls.Config, error) {
	if !f.Enabled() {
		return nil, nil
	}
	if (f.Cert == "") != (f.Key == "") {
		return nil, errors.New("tlsconfig: a client certificate needs both --tls-cert and --tls-key")
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if f.CA != "" {
		pool, err := loadPool(f.CA)
		if err != nil {
			return nil, err
		}
		cfg.RootCAs = pool
	}
	if f.Cert != "" {
		cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
		if err != nil {
			return nil, fmt.Errorf("tlsconfig: load client key pair: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// ServerCredentials is Server as gRPC transport credentials (insecure
// when no file is set).
func ServerCredentials(f Files) (credentials.TransportCredentials, error) {
	cfg, err := Server(f)
	if err != nil {
		return nil, err
	}
	if cfg == nil {
		return insecure.NewCredentials(), nil
	}
	return credentials.NewTLS(cfg), nil
}

// ClientCredentials is Client as gRPC transport credentials (insecure
// when no file is set).
func ClientCredentials(f Files) (credentials.TransportCredentials, error) {
	cfg, err := Client(f)
	if err != nil {
		return nil, err
	}
	if cfg == nil {
		return insecure.NewCredentials(), nil
	}
	return credentials.NewTLS(cfg), nil
}

func loadPool(path string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tlsconfig: read CA bundle: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("tlsconfig: no PEM certificate in CA bundle %s", path)
	}
	return pool, nil
}
