package main

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/plugin"
)

func TestParseArgs(t *testing.T) {
	dir := t.TempDir()
	ca, err := testpki.NewCA("plugin.test")
	require.NoError(t, err)
	caFile, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	notPEM := filepath.Join(dir, "not.pem")
	require.NoError(t, os.WriteFile(notPEM, []byte("hello"), 0o600))

	required := []string{"--broker-address", "broker.example:8443", "--ca-file", caFile}
	with := func(args ...string) []string { return append(append([]string(nil), required...), args...) }

	tests := []struct {
		name    string
		args    []string
		check   func(t *testing.T, cfg plugin.Config)
		wantErr string
	}{
		{
			name: "defaults",
			args: required,
			check: func(t *testing.T, cfg plugin.Config) {
				assert.Equal(t, "broker.example:8443", cfg.BrokerAddress)
				require.NotNil(t, cfg.TLS)
				assert.NotNil(t, cfg.TLS.RootCAs)
				assert.False(t, cfg.TLS.InsecureSkipVerify)
				assert.Equal(t, defaultTokenFile, cfg.TokenFile)
				assert.Nil(t, cfg.Cluster)
				assert.Nil(t, cfg.ServiceAccount)
				assert.Empty(t, cfg.Audiences)
				assert.Zero(t, cfg.ExpirationSeconds)
				assert.Equal(t, plugin.DefaultTimeout, cfg.Timeout)
			},
		},
		{
			name: "everything",
			args: with("--token-file", "/tok", "--cluster", "fleet/prod-eu-1", "--service-account", "apps/deployer",
				"--audience", "a,b, c ", "--expiration-seconds", "3600", "--timeout", "5s"),
			check: func(t *testing.T, cfg plugin.Config) {
				assert.Equal(t, "/tok", cfg.TokenFile)
				assert.Equal(t, &plugin.Reference{Namespace: "fleet", Name: "prod-eu-1"}, cfg.Cluster)
				assert.Equal(t, &plugin.Reference{Namespace: "apps", Name: "deployer"}, cfg.ServiceAccount)
				assert.Equal(t, []string{"a", "b", "c"}, cfg.Audiences)
				assert.EqualValues(t, 3600, cfg.ExpirationSeconds)
				assert.Equal(t, 5*time.Second, cfg.Timeout)
			},
		},
		{name: "single dash flags", args: []string{"-broker-address=b:1", "-ca-file=" + caFile}},
		{name: "help", args: []string{"--help"}, wantErr: pflag.ErrHelp.Error()},
		{name: "verbosity", args: []string{"--broker-address=b:1", "--ca-file=" + caFile, "-v=2", "--v=2"}},
		{name: "negative verbosity", args: []string{"--broker-address=b:1", "--ca-file=" + caFile, "-v=-1"}, wantErr: "-v -1 is negative"},
		{name: "version", args: []string{"--version"}, wantErr: "version requested"},
		{name: "verbosity and version", args: []string{"-v=2", "--version"}, wantErr: "version requested"},
		{name: "no broker address", args: []string{"--ca-file", caFile}, wantErr: "--broker-address is required"},
		{name: "no CA file", args: []string{"--broker-address", "b:1"}, wantErr: "--ca-file is required"},
		{name: "missing CA file", args: []string{"--broker-address", "b:1", "--ca-file", filepath.Join(dir, "nope.pem")}, wantErr: "nope.pem: no such file"},
		{name: "CA file without PEM", args: []string{"--broker-address", "b:1", "--ca-file", notPEM}, wantErr: "holds no PEM certificate"},
		{name: "empty token file", args: with("--token-file", ""), wantErr: "--token-file must not be empty"},
		{name: "bad cluster", args: with("--cluster", "prod-eu-1"), wantErr: "--cluster: \"prod-eu-1\" is not of the form <namespace>/<name>"},
		{name: "bad service account", args: with("--service-account", "apps/Deployer"), wantErr: "--service-account:"},
		{name: "empty audience", args: with("--audience", "a,,b"), wantErr: "empty value"},
		{name: "negative expiration", args: with("--expiration-seconds", "-5"), wantErr: "negative"},
		{name: "bad expiration", args: with("--expiration-seconds", "1h"), wantErr: `invalid argument "1h" for "--expiration-seconds" flag`},
		{name: "no log format on the plugin", args: with("--log-format=json"), wantErr: "unknown flag: --log-format"},
		{name: "zero timeout", args: with("--timeout", "0s"), wantErr: "--timeout 0s is not positive"},
		{name: "unknown flag", args: with("--kubeconfig", "x"), wantErr: "unknown flag: --kubeconfig (see --help)"},
		{
			name: "a flag given twice", args: with("--broker-address", "evil.example:443"),
			wantErr: `invalid argument "evil.example:443" for "--broker-address" flag: given before as "broker.example:8443", ` +
				`and a ClusterProfile's additional-args may not override it`,
		},
		{name: "an empty value after another", args: with("--cluster", "fleet/a", "--cluster="), wantErr: `for "--cluster" flag: given before as "fleet/a"`},
		{
			// Older credbroker kubeconfig wrote one --audience per audience:
			// those kubeconfigs keep working. An extra audience cannot
			// redirect the token, and the spoke's opt-in gates each one.
			name: "an audience flag per audience, as older kubeconfigs have",
			args: with("--audience", "a", "--audience", "b", "--audience", "c,d"),
			check: func(t *testing.T, cfg plugin.Config) {
				assert.Equal(t, []string{"a", "b", "c", "d"}, cfg.Audiences)
			},
		},
		{
			name: "audiences given again are taken once",
			args: with("--audience", "a", "--audience", "a,b", "--audience", "b"),
			check: func(t *testing.T, cfg plugin.Config) {
				assert.Equal(t, []string{"a", "b"}, cfg.Audiences)
			},
		},
		{name: "an empty audience after another", args: with("--audience", "a", "--audience="), wantErr: "empty value"},
		{
			name: "the same flags again",
			args: append(with("--cluster", "fleet/a", "--audience", "a,b"), with("--cluster=fleet/a", "--audience", "a,b")...),
			check: func(t *testing.T, cfg plugin.Config) {
				assert.Equal(t, &plugin.Reference{Namespace: "fleet", Name: "a"}, cfg.Cluster)
				assert.Equal(t, []string{"a", "b"}, cfg.Audiences, "a value given again is taken once")
			},
		},
		{name: "positional argument", args: with("extra"), wantErr: "unexpected arguments"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := parseArgs(tt.args)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			if tt.check != nil {
				tt.check(t, cfg)
			}
			_, err = plugin.New(cfg)
			require.NoError(t, err, "parseArgs must produce a Config that plugin.New accepts")
		})
	}
}

// Every flag but --audience takes one value: a ClusterProfile's appended
// additional-args cannot override it. The same value again is taken.
func TestEveryFlagButAudienceTakesOneValue(t *testing.T) {
	dir := t.TempDir()
	ca, err := testpki.NewCA("plugin.test")
	require.NoError(t, err)
	caFile, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	other, err := testpki.NewCA("other.test")
	require.NoError(t, err)
	otherDir := filepath.Join(dir, "other")
	require.NoError(t, os.Mkdir(otherDir, 0o700))
	otherCAFile, err := other.WriteBundle(otherDir)
	require.NoError(t, err)
	values := map[string][2]string{
		"broker-address":     {"broker.example:8443", "evil.example:443"},
		"ca-file":            {caFile, otherCAFile},
		"token-file":         {"/tok", "/evil"},
		"cluster":            {"fleet/a", "fleet/b"},
		"service-account":    {"apps/a", "apps/b"},
		"expiration-seconds": {"600", "3600"},
		"timeout":            {"5s", "6s"},
		"v":                  {"1", "2"},
	}
	var o options
	fs, _ := newFlagSet(&o)
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Name == audienceFlag || f.Value.Type() == "bool" {
			return
		}
		v, ok := values[f.Name]
		if !assert.True(t, ok, "no values to test --%s with", f.Name) {
			return
		}
		base := []string{"--broker-address", values["broker-address"][0], "--ca-file", caFile}
		named := "--" + f.Name // as pflag's errors name the flag
		if f.Shorthand != "" {
			named = "-" + f.Shorthand + ", " + named
		}
		t.Run(f.Name, func(t *testing.T) {
			_, err := parseArgs(append(base, "--"+f.Name, v[0], "--"+f.Name, v[1]))
			require.ErrorContains(t, err, `for "`+named+`" flag: given before as`)
			_, err = parseArgs(append(base, "--"+f.Name, v[0], "--"+f.Name, v[0]))
			require.NoError(t, err, "the same value again is taken")
		})
	})
}

func TestNewProviderRejectsBadAddress(t *testing.T) {
	ca, err := testpki.NewCA("plugin.test")
	require.NoError(t, err)
	caFile, err := ca.WriteBundle(t.TempDir())
	require.NoError(t, err)
	_, err = newProvider([]string{"--broker-address", "broker.example", "--ca-file", caFile})
	require.ErrorContains(t, err, "not host:port")
}
