package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/brokerclient"
	"github.com/credbroker/credbroker/pkg/plugin"
)

// defaultTokenFile is where the consumer pod mounts its projected hub
// ServiceAccount token.
const defaultTokenFile = "/var/run/secrets/credbroker/token"

type options struct {
	brokerAddress     string
	caFile            string
	tokenFile         string
	cluster           string
	serviceAccount    string
	audiences         listFlag
	expirationSeconds int64
	timeout           time.Duration
}

const usage = `Usage: credbroker-plugin --broker-address host:port --ca-file ca.pem [flags]

A client-go exec credential plugin (client.authentication.k8s.io/v1) that
exchanges the pod's hub ServiceAccount token for a spoke token at the
credbroker broker. The exec config must set provideClusterInfo: true.`

func newFlagSet(o *options) (*pflag.FlagSet, *cmdflags.Common) {
	fs, common := cmdflags.New("credbroker-plugin", usage)
	fs.StringVar(&o.brokerAddress, "broker-address", "", "broker gRPC address, host:port (required)")
	fs.StringVar(&o.caFile, "ca-file", "", "PEM file of the CA certificates that verify the broker (required)")
	fs.StringVar(&o.tokenFile, "token-file", defaultTokenFile, "file holding the projected hub ServiceAccount token, audience \"credbroker\"; read on every call")
	fs.StringVar(&o.cluster, "cluster", "", "ClusterProfile `<namespace>/<name>` to get a token for; overrides ExecCredential spec.cluster.config")
	fs.StringVar(&o.serviceAccount, "service-account", "", "spoke ServiceAccount `<namespace>/<name>` to get a token for; default: the single one that allows the caller")
	fs.Var(&o.audiences, audienceFlag, "`audience` of the spoke token; repeatable or comma-separated; default: the spoke API server's")
	fs.Int64Var(&o.expirationSeconds, "expiration-seconds", 0, "requested token lifetime in seconds; 0 means the broker's maximum")
	fs.DurationVar(&o.timeout, "timeout", plugin.DefaultTimeout, "bound on one token request, connection included")
	common.AddVerbosityFlag(cmdflags.QuietVerbosityUsage)
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Name != audienceFlag {
			f.Value = &onceValue{Value: f.Value}
		}
	})
	return fs, common
}

// audienceFlag is the one flag that takes several values: its repeats
// add audiences, as they did before every other flag took one value, so
// that a kubeconfig with one --audience per audience keeps working. An
// audience appended by a ClusterProfile's additional-args cannot redirect
// the token (the server and CA are pinned by the broker's answer), and the
// spoke's opt-in must allow each audience, or the exchange is refused.
const audienceFlag = "audience"

// onceValue is a flag that takes one value. cluster-inventory-api's
// pkg/access, with a provider's profileSourcedCLIArgsPolicy: Append, appends
// a ClusterProfile's additional-args to the provider file's, and pflag keeps
// a flag's last value: a status writer could send the hub token to a
// broker address, CA or token file of theirs. So a second value that
// differs from the first is refused. The same value again is taken, since
// pkg/access appends the same additional-args again on every
// BuildConfigFromCP of one process.
type onceValue struct {
	pflag.Value
	first *string
}

func (v *onceValue) Set(s string) error {
	if v.first != nil {
		if s == *v.first {
			return nil
		}
		return fmt.Errorf("given before as %q, and a ClusterProfile's additional-args may not override it: give each flag "+
			"of credbroker-plugin once, in the provider file's args, and leave profileSourcedCLIArgsPolicy unset for the %s provider",
			*v.first, plugin.Name)
	}
	if err := v.Value.Set(s); err != nil {
		return err
	}
	v.first = &s
	return nil
}

// newProvider parses args and builds the Provider. It returns an error
// wrapping pflag.ErrHelp for -h and --help, and cmdflags.ErrVersion for
// --version.
func newProvider(args []string) (*plugin.Provider, error) {
	cfg, err := parseArgs(args)
	if err != nil {
		return nil, err
	}
	return plugin.New(cfg)
}

// exitOnParse ends the process when newProvider returned err rather than a
// provider: it prints the help or the version and exits 0, or prints err
// as the plugin prints its errors and exits 2. It returns when err is nil.
func exitOnParse(err error) {
	switch {
	case cmdflags.IsHelpOrVersion(err):
		cmdflags.ExitOnParse("credbroker-plugin", err)
	case err != nil:
		fmt.Fprintf(os.Stderr, "[%s] %v\n", plugin.Name, err)
		os.Exit(2)
	}
}

// parseArgs turns the command line into a validated plugin.Config.
func parseArgs(args []string) (plugin.Config, error) {
	var o options
	_, common := newFlagSet(&o)
	if err := common.Parse(args); err != nil {
		return plugin.Config{}, err
	}
	return o.config()
}

func (o *options) config() (plugin.Config, error) {
	if o.brokerAddress == "" {
		return plugin.Config{}, errors.New("--broker-address is required")
	}
	if o.caFile == "" {
		return plugin.Config{}, errors.New("--ca-file is required")
	}
	if o.tokenFile == "" {
		return plugin.Config{}, errors.New("--token-file must not be empty")
	}
	if o.expirationSeconds < 0 {
		return plugin.Config{}, fmt.Errorf("--expiration-seconds %d is negative", o.expirationSeconds)
	}
	if o.timeout <= 0 {
		return plugin.Config{}, fmt.Errorf("--timeout %v is not positive", o.timeout)
	}
	roots, err := loadCAFile(o.caFile)
	if err != nil {
		return plugin.Config{}, err
	}
	cfg := plugin.Config{
		BrokerAddress:     o.brokerAddress,
		TLS:               &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		TokenFile:         o.tokenFile,
		Audiences:         o.audiences,
		ExpirationSeconds: o.expirationSeconds,
		Timeout:           o.timeout,
	}
	if o.cluster != "" {
		r, err := plugin.ParseReference(o.cluster)
		if err != nil {
			return plugin.Config{}, fmt.Errorf("--cluster: %w", err)
		}
		cfg.Cluster = &r
	}
	if o.serviceAccount != "" {
		r, err := plugin.ParseReference(o.serviceAccount)
		if err != nil {
			return plugin.Config{}, fmt.Errorf("--service-account: %w", err)
		}
		cfg.ServiceAccount = &r
	}
	return cfg, nil
}

func loadCAFile(name string) (*x509.CertPool, error) {
	pool, err := brokerclient.LoadCAFile(name)
	if err != nil {
		return nil, fmt.Errorf("--ca-file: %w", err)
	}
	return pool, nil
}

// listFlag is a repeatable flag whose values may also be comma-separated.
// A value given again is taken once, since pkg/access appends the same
// additional-args again on every BuildConfigFromCP of one process.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Type() string { return "strings" }

func (l *listFlag) Set(s string) error {
	for v := range strings.SplitSeq(s, ",") {
		v = strings.TrimSpace(v)
		if v == "" {
			return fmt.Errorf("empty value in %q", s)
		}
		if !slices.Contains(*l, v) {
			*l = append(*l, v)
		}
	}
	return nil
}
