package main

import (
	"crypto/tls"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/pflag"

	"github.com/credbroker/credbroker/pkg/brokerclient"
	"github.com/credbroker/credbroker/pkg/grants/selector"
	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// stdinName is the --token-file value that reads the token from standard
// input.
const stdinName = "-"

// connOptions are the flags of the connection to the broker.
type connOptions struct {
	broker    string
	caFile    string
	tokenFile string
	timeout   time.Duration
}

func (o *connOptions) addFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.broker, "broker-address", "", "broker exchange address, host:port (required); --broker is the same flag")
	fs.SetNormalizeFunc(brokerAlias)
	fs.StringVar(&o.caFile, "ca-file", "", "PEM file of the CA certificates that verify the broker's TLS certificate (required)")
	fs.StringVar(&o.tokenFile, "token-file", "", `file holding a hub ServiceAccount token for the broker's audience, such as the output of `+
		`"kubectl create token NAME --audience credbroker"; "-" reads it from standard input (required)`)
	fs.DurationVar(&o.timeout, "timeout", defaultTimeout, "bound on the call, connection included")
}

// connConfig is the validated connection to the broker.
type connConfig struct {
	Broker string
	TLS    *tls.Config
	// TokenFile is a file name, or stdinName.
	TokenFile string
	Timeout   time.Duration
	// caFile is the name TLS was loaded from.
	caFile string
}

// brokerAlias makes --broker, the name the grants commands had first, the
// same flag as --broker-address, the plugin's name for it.
func brokerAlias(_ *pflag.FlagSet, name string) pflag.NormalizedName {
	if name == "broker" {
		name = "broker-address"
	}
	return pflag.NormalizedName(name)
}

func (o *connOptions) config() (connConfig, error) {
	var errs []error
	if o.broker == "" {
		errs = append(errs, errors.New("--broker-address is required"))
	} else if err := brokerclient.ValidateAddress(o.broker); err != nil {
		errs = append(errs, fmt.Errorf("--broker-address: %w", err))
	}
	if o.caFile == "" {
		errs = append(errs, errors.New("--ca-file is required"))
	}
	if o.tokenFile == "" {
		errs = append(errs, errors.New("--token-file is required (\"-\" for standard input)"))
	}
	if o.timeout <= 0 {
		errs = append(errs, fmt.Errorf("--timeout %v is not positive", o.timeout))
	}
	if len(errs) > 0 {
		return connConfig{}, errors.Join(errs...)
	}
	roots, err := brokerclient.LoadCAFile(o.caFile)
	if err != nil {
		return connConfig{}, fmt.Errorf("--ca-file: %w", err)
	}
	return connConfig{
		caFile:    o.caFile,
		Broker:    o.broker,
		TLS:       &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		TokenFile: o.tokenFile,
		Timeout:   o.timeout,
	}, nil
}

// selectorOptions are the flags that pick grants.
type selectorOptions struct {
	cluster      string
	user         string
	credentialID string
}

func (o *selectorOptions) addFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.cluster, "cluster", "", "ClusterProfile `<namespace>/<name>` of the grants")
	fs.StringVar(&o.user, "user", "", "hub username of the grants' consumer, such as system:serviceaccount:argocd:argocd-application-controller")
	fs.StringVar(&o.credentialID, "credential-id", "", "credential id of one token, JTI=<jti>, as the broker's audit log and 'grants list' show it")
}

// selector validates the flags as the broker would.
func (o *selectorOptions) selector() (*pb.GrantSelector, error) {
	sel := &pb.GrantSelector{CredentialId: o.credentialID, Username: o.user}
	if o.cluster != "" {
		r, err := plugin.ParseReference(o.cluster)
		if err != nil {
			return nil, fmt.Errorf("--cluster: %w", err)
		}
		sel.Cluster = &pb.ObjectReference{Namespace: r.Namespace, Name: r.Name}
	}
	if err := selector.Check(sel); err != nil {
		return nil, err
	}
	return sel, nil
}

func (o *selectorOptions) empty() bool { return *o == selectorOptions{} }

// Output formats.
const (
	outputTable = "table"
	outputJSON  = "json"
)

func validOutput(s string) error {
	if s != outputTable && s != outputJSON {
		return fmt.Errorf("-o/--output %q: want %s or %s", s, outputTable, outputJSON)
	}
	return nil
}

// listConfig is a validated 'grants list'.
type listConfig struct {
	Conn     connConfig
	Selector *pb.GrantSelector
	Output   string
}

// revokeConfig is a validated 'grants revoke'.
type revokeConfig struct {
	Conn     connConfig
	Selector *pb.GrantSelector
	Reason   string
	Output   string
}

type listOptions struct {
	conn   connOptions
	sel    selectorOptions
	output string
}

func (o *listOptions) config() (listConfig, error) {
	if err := validOutput(o.output); err != nil {
		return listConfig{}, err
	}
	sel, err := o.sel.selector()
	if err != nil {
		return listConfig{}, err
	}
	conn, err := o.conn.config()
	if err != nil {
		return listConfig{}, err
	}
	return listConfig{Conn: conn, Selector: sel, Output: o.output}, nil
}

type revokeOptions struct {
	conn   connOptions
	sel    selectorOptions
	reason string
	output string
}

func (o *revokeOptions) config() (revokeConfig, error) {
	if err := validOutput(o.output); err != nil {
		return revokeConfig{}, err
	}
	if o.sel.empty() {
		return revokeConfig{}, errors.New("say what to revoke: --credential-id, --user or --cluster (several narrow it down)")
	}
	sel, err := o.sel.selector()
	if err != nil {
		return revokeConfig{}, err
	}
	conn, err := o.conn.config()
	if err != nil {
		return revokeConfig{}, err
	}
	return revokeConfig{Conn: conn, Selector: sel, Reason: o.reason, Output: o.output}, nil
}
