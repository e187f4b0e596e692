package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/dns/dnsmessage"
)

// dnsServer answers PTR and A queries from its maps over UDP on loopback,
// as Docker's embedded DNS does on a compose network: NXDOMAIN for any
// other name.
type dnsServer struct {
	ptr map[string]string // "5.0.0.10.in-addr.arpa." -> "proj_thinker_2.proj_default."
	a   map[string]string // "proj_thinker_2." -> "10.0.0.5"
}

func startDNS(t *testing.T, srv dnsServer) (addr string, r *net.Resolver) {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			if out, ok := srv.answer(buf[:n]); ok {
				_, _ = pc.WriteTo(out, from)
			}
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	addr = pc.LocalAddr().String()
	return addr, &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", addr)
	}}
}

func (s dnsServer) answer(query []byte) ([]byte, bool) {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil {
		return nil, false
	}
	q, err := p.Question()
	if err != nil {
		return nil, false
	}
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionAvailable: true})
	b.EnableCompression()
	name := strings.ToLower(q.Name.String())
	rh := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 600}
	var answer func() error
	known := false
	switch q.Type {
	case dnsmessage.TypePTR:
		if target, ok := s.ptr[name]; ok {
			known = true
			answer = func() error {
				return b.PTRResource(rh, dnsmessage.PTRResource{PTR: dnsmessage.MustNewName(target)})
			}
		}
	case dnsmessage.TypeA:
		if ip, ok := s.a[name]; ok {
			known = true
			answer = func() error {
				var a [4]byte
				copy(a[:], net.ParseIP(ip).To4())
				return b.AResource(rh, dnsmessage.AResource{A: a})
			}
		}
	default: // AAAA of a name with an A record: no data, not NXDOMAIN
		_, known = s.a[name]
	}
	if !known {
		b = dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, RCode: dnsmessage.RCodeNameError})
	}
	if b.StartQuestions() != nil || b.Question(q) != nil {
		return nil, false
	}
	if answer != nil {
		if b.StartAnswers() != nil || answer() != nil {
			return nil, false
		}
	}
	out, err := b.Finish()
	return out, err == nil
}

// TestReverseName: --advertise-dns advertises the name DNS gives the
// host's address (the compose container's name, the network's suffix cut
// when the short name leads back to the same address), checked forward;
// a name that leads elsewhere, or none, is not advertised.
func TestReverseName(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	ip := net.ParseIP("10.0.0.5")
	other := net.ParseIP("10.0.0.6")
	addr, r := startDNS(t, dnsServer{
		ptr: map[string]string{
			"5.0.0.10.in-addr.arpa.": "proj_thinker_2.proj_default.",
			"6.0.0.10.in-addr.arpa.": "spoofed.example.",
			"7.0.0.10.in-addr.arpa.": "shared.lan.",
		},
		a: map[string]string{
			"proj_thinker_2.":              "10.0.0.5",
			"proj_thinker_2.proj_default.": "10.0.0.5",
			"spoofed.example.":             "10.9.9.9", // does not lead back
			"shared.":                      "10.0.0.99",
			"shared.lan.":                  "10.0.0.7",
		},
	})
	// A server that does not answer is passed over for the next.
	dead, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	deadAddr := dead.LocalAddr().String()
	require.NoError(t, dead.Close())
	servers := []string{deadAddr, addr}
	assert.Equal(t, "proj_thinker_2", reverseName(ctx, servers, r, []net.IP{ip}), "the container's name, as docker ps shows it")
	assert.Equal(t, "proj_thinker_2", reverseName(ctx, servers, r, []net.IP{net.ParseIP("10.0.0.8"), ip}), "an address without a name is skipped")
	assert.Equal(t, "shared.lan", reverseName(ctx, servers, r, []net.IP{net.ParseIP("10.0.0.7")}), "the first label leads elsewhere: the whole name")
	assert.Empty(t, reverseName(ctx, servers, r, []net.IP{other}), "a name that does not lead back is not advertised")
	assert.Empty(t, reverseName(ctx, servers, r, []net.IP{net.ParseIP("10.0.0.8")}))
	assert.Empty(t, reverseName(ctx, servers, r, nil))
}

func TestNameservers(t *testing.T) {
	path := filepath.Join(t.TempDir(), "resolv.conf")
	require.NoError(t, os.WriteFile(path, []byte("# Docker's\nnameserver 127.0.0.11\nsearch example.com\nnameserver ::1\nnameserver bogus\noptions ndots:0\n"), 0o600))
	assert.Equal(t, []string{"127.0.0.11:53", "[::1]:53"}, nameservers(path))
	assert.Empty(t, nameservers(filepath.Join(t.TempDir(), "missing")))
	name, err := reverseArpa(net.ParseIP("2001:db8::1"))
	require.NoError(t, err)
	assert.Equal(t, "1.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.0.8.b.d.0.1.0.0.2.ip6.arpa.", name.String())
	name, err = reverseArpa(net.ParseIP("172.18.0.3"))
	require.NoError(t, err)
	assert.Equal(t, "3.0.18.172.in-addr.arpa.", name.String())
}

func TestAllInterfaces(t *testing.T) {
	for listen, want := range map[string]bool{
		"0.0.0.0:7000": true, ":7000": true, "[::]:7000": true,
		"127.0.0.1:7000": false, "10.0.0.2:7000": false, "worker-1:7000": false, "7000": false,
	} {
		assert.Equal(t, want, allInterfaces(listen), listen)
	}
}
