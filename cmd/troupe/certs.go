package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/troupe-serving/troupe/pkg/clusterauth"
)

// runCerts writes what a cluster's head → worker link needs into --out: a
// CA (ca.pem, ca-key.pem), the head's client certificate (head.pem,
// head-key.pem), the workers' serving certificate (worker.pem,
// worker-key.pem, one certificate for every name in --hosts), the HTTP
// API's serving certificate (api.pem, api-key.pem, for the same names:
// troupe head --http-tls-cert) and a cluster token (cluster-token). Files that exist are kept, so it can be run again
// to add what is missing; keys and the token are written 0600.
func runCerts(_ context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("certs")
	out := fs.String("out", "pki", "directory to write the files into")
	hosts := fs.String("hosts", "localhost,127.0.0.1", "comma-separated DNS names and IPs the workers' and the API's certificates are valid for (the workers' --advertise hosts, the names clients reach the head by)")
	validity := fs.Duration("validity", 365*24*time.Hour, "how long the certificates are valid")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return fmt.Errorf("certs: %w", err)
	}
	path := func(name string) string { return filepath.Join(*out, name) }
	exists := func(name string) bool { _, err := os.Stat(path(name)); return err == nil }

	if !exists("cluster-token") {
		if err := os.WriteFile(path("cluster-token"), []byte(clusterauth.NewToken()+"\n"), 0o600); err != nil {
			return fmt.Errorf("certs: %w", err)
		}
		fmt.Fprintf(stdout, "troupe certs: wrote %s\n", path("cluster-token"))
	}
	var ca *x509.Certificate
	var caKey *ecdsa.PrivateKey
	if exists("ca.pem") && exists("ca-key.pem") {
		var err error
		if ca, caKey, err = loadPair(path("ca.pem"), path("ca-key.pem")); err != nil {
			return err
		}
	} else {
		tmpl := certTemplate("troupe cluster CA", *validity)
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
		var err error
		if ca, caKey, err = issue(tmpl, nil, nil, path("ca.pem"), path("ca-key.pem")); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "troupe certs: wrote %s and %s\n", path("ca.pem"), path("ca-key.pem"))
	}
	// head: the head's client certificate toward the workers; worker: the
	// workers' server certificate; api: the head's HTTP API's server
	// certificate (troupe head --http-tls-cert), which clients verify
	// with ca.pem.
	for _, who := range []string{"head", "worker", "api"} {
		if exists(who + ".pem") {
			continue
		}
		tmpl := certTemplate("troupe "+who, *validity)
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
		if who != "head" {
			tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
			if who == "worker" {
				// A worker is also a client of other workers: it pushes
				// its engine's tensors to the next stage's (PushTensors).
				tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
			}
			for _, h := range splitList(*hosts) {
				if ip := net.ParseIP(h); ip != nil {
					tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
				} else {
					tmpl.DNSNames = append(tmpl.DNSNames, h)
				}
			}
		}
		if _, _, err := issue(tmpl, ca, caKey, path(who+".pem"), path(who+"-key.pem")); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "troupe certs: wrote %s and %s\n", path(who+".pem"), path(who+"-key.pem"))
	}
	return nil
}

func certTemplate(cn string, validity time.Duration) *x509.Certificate {
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127)) // crypto/rand never fails
	return &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(validity),
	}
}

// issue signs tmpl with parent (itself when parent is nil) and writes the
// certificate and a new key.
func issue(tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, certPath, keyPath string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("certs: %w", err)
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		return nil, nil, fmt.Errorf("certs: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("certs: %w", err)
	}
	if err := os.WriteFile(keyPath, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return nil, nil, fmt.Errorf("certs: %w", err)
	}
	if err := os.WriteFile(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return nil, nil, fmt.Errorf("certs: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	return cert, key, err
}

// loadPair reads an existing CA to sign with.
func loadPair(certPath, keyPath string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cb, err := os.ReadFile(certPath)
	if err != nil {
		return nil, nil, fmt.Errorf("certs: %w", err)
	}
	kb, err := os.ReadFile(keyPath)
	if err != nil {
		return nil, nil, fmt.Errorf("certs: %w", err)
	}
	cblock, _ := pem.Decode(cb)
	kblock, _ := pem.Decode(kb)
	if cblock == nil || kblock == nil {
		return nil, nil, errors.New("certs: the CA files hold no PEM block")
	}
	cert, err := x509.ParseCertificate(cblock.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("certs: %w", err)
	}
	k, err := x509.ParsePKCS8PrivateKey(kblock.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("certs: %w", err)
	}
	key, ok := k.(*ecdsa.PrivateKey)
	if !ok {
		return nil, nil, errors.New("certs: the CA key is not ECDSA")
	}
	return cert, key, nil
}
