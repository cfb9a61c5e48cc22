package broker

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/go-jose/go-jose/v4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

func TestIssuerKeysFromFile(t *testing.T) {
	hub, err := kubernetes.NewForConfig(&rest.Config{Host: "https://hub.invalid"})
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	doc, err := json.Marshal(jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &key.PublicKey, KeyID: "k1", Use: "sig"}}})
	require.NoError(t, err)
	dir := t.TempDir()
	good := filepath.Join(dir, "jwks.json")
	require.NoError(t, os.WriteFile(good, doc, 0o600))
	empty := filepath.Join(dir, "empty.json")
	require.NoError(t, os.WriteFile(empty, []byte(`{"keys":[]}`), 0o600))

	cfg := Default()
	cfg.IssuerJWKSFile = good
	keys, err := newIssuerKeys(cfg, hub, nil)
	require.NoError(t, err)
	assert.True(t, keys.Loaded(), "a key file is loaded at once")

	cfg.IssuerJWKSFile = empty
	_, err = newIssuerKeys(cfg, hub, nil)
	assert.ErrorContains(t, err, "issuer keys in "+empty+": hubkeys: the key set holds no RSA or EC signing key (of 0 keys)")

	cfg.IssuerJWKSFile = filepath.Join(dir, "missing.json")
	_, err = newIssuerKeys(cfg, hub, nil)
	assert.ErrorContains(t, err, "no such file or directory")

	cfg.IssuerJWKSFile = ""
	keys, err = newIssuerKeys(cfg, hub, nil)
	require.NoError(t, err)
	assert.False(t, keys.Loaded(), "the hub's keys are fetched when the broker runs")
}
