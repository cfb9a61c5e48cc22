package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// defaultPluginTokenFile is where a consumer pod mounts its projected hub
// ServiceAccount token, and the plugin's default --token-file.
const defaultPluginTokenFile = "/var/run/secrets/credbroker/token"

// kubeconfigOptions are the flags of 'kubeconfig'.
type kubeconfigOptions struct {
	conn              connOptions
	cluster           string
	serviceAccount    string
	audiences         []string
	expirationSeconds int64
	pluginPath        string
	output            string
}

// kubeconfigConfig is a validated 'kubeconfig'.
type kubeconfigConfig struct {
	Conn           connConfig
	Cluster        plugin.Reference
	ServiceAccount *plugin.Reference
	// PluginArgs are the plugin's flags, with absolute file names.
	PluginArgs []string
	PluginPath string
	// Output is a file name, or "" for standard output.
	Output string
}

func (o *kubeconfigOptions) config() (kubeconfigConfig, error) {
	if o.cluster == "" {
		return kubeconfigConfig{}, errors.New("--cluster <namespace>/<name> is required")
	}
	cluster, err := plugin.ParseReference(o.cluster)
	if err != nil {
		return kubeconfigConfig{}, fmt.Errorf("--cluster: %w", err)
	}
	if o.conn.tokenFile == stdinName {
		return kubeconfigConfig{}, errors.New("--token-file: the plugin reads the token from a file on every call; standard input will not do")
	}
	if o.pluginPath == "" {
		return kubeconfigConfig{}, errors.New("--plugin-path must not be empty")
	}
	if o.expirationSeconds < 0 {
		return kubeconfigConfig{}, fmt.Errorf("--expiration-seconds %d is negative", o.expirationSeconds)
	}
	conn, err := o.conn.config()
	if err != nil {
		return kubeconfigConfig{}, err
	}
	// The plugin runs in the directory of whoever uses the kubeconfig.
	caFile, err := filepath.Abs(conn.caFile)
	if err != nil {
		return kubeconfigConfig{}, fmt.Errorf("--ca-file: %w", err)
	}
	tokenFile, err := filepath.Abs(conn.TokenFile)
	if err != nil {
		return kubeconfigConfig{}, fmt.Errorf("--token-file: %w", err)
	}
	args := []string{"--broker-address", conn.Broker, "--ca-file", caFile, "--token-file", tokenFile,
		"--cluster", cluster.String()}
	cfg := kubeconfigConfig{Conn: conn, Cluster: cluster, PluginPath: o.pluginPath, Output: o.output}
	if o.serviceAccount != "" {
		sa, err := plugin.ParseReference(o.serviceAccount)
		if err != nil {
			return kubeconfigConfig{}, fmt.Errorf("--service-account: %w", err)
		}
		cfg.ServiceAccount = &sa
		args = append(args, "--service-account", sa.String())
	}
	// The plugin takes each flag once, so that a ClusterProfile's
	// additional-args cannot override one: the audiences go in one.
	if len(o.audiences) > 0 {
		args = append(args, "--audience", strings.Join(o.audiences, ","))
	}
	if o.expirationSeconds > 0 {
		args = append(args, "--expiration-seconds", strconv.FormatInt(o.expirationSeconds, 10))
	}
	if conn.Timeout != defaultTimeout {
		args = append(args, "--timeout", conn.Timeout.String())
	}
	cfg.PluginArgs = args
	return cfg, nil
}

func newKubeconfigCommand(s streams) *cobra.Command {
	o := &kubeconfigOptions{}
	cmd := &cobra.Command{
		Use:   "kubeconfig --cluster NAMESPACE/NAME",
		Short: "Print a kubeconfig whose user gets spoke tokens through credbroker-plugin",
		Long: `kubeconfig asks the broker once for the server and CA of the ClusterProfile's
spoke (it discards the token that comes with them) and prints a kubeconfig
whose cluster carries them and whose user execs credbroker-plugin with the
same flags, so that every kubectl or client-go call gets a fresh spoke token.
The hub token file must stay readable to whoever uses the kubeconfig; the
plugin reads it on every call. File names are written as absolute paths.
The kubeconfig holds no token.`,
		Example: `  kubectl create token deployer -n team-a --audience credbroker > hub-token
  credbroker kubeconfig --cluster fleet/spoke-1 --broker-address credbroker.example:8443 --ca-file ca.pem --token-file hub-token -o spoke-1.kubeconfig
  kubectl --kubeconfig spoke-1.kubeconfig get namespaces`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := o.config()
			if err != nil {
				return usageError{err}
			}
			req := &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: cfg.Cluster.Namespace, Name: cfg.Cluster.Name}}
			if sa := cfg.ServiceAccount; sa != nil {
				req.ServiceAccount = &pb.ObjectReference{Namespace: sa.Namespace, Name: sa.Name}
			}
			var resp *pb.ExchangeResponse
			err = call(cmd.Context(), cfg.Conn, s.in, func(ctx context.Context, conn grpc.ClientConnInterface, opt grpc.CallOption) (err error) {
				resp, err = pb.NewTokenExchangeClient(conn).Exchange(ctx, req, opt)
				return err
			})
			if err != nil {
				return err
			}
			if resp.GetServer() == "" {
				return rpcError{fmt.Errorf("broker %s answered no server for cluster %s", cfg.Conn.Broker, cfg.Cluster)}
			}
			return writeKubeconfig(s, cfg, buildKubeconfig(cfg, resp.GetServer(), resp.GetCertificateAuthorityData()))
		},
	}
	o.conn.addFlags(cmd.Flags())
	cmd.Flags().Lookup("token-file").DefValue = defaultPluginTokenFile
	o.conn.tokenFile = defaultPluginTokenFile
	cmd.Flags().Lookup("token-file").Usage = "file holding the hub ServiceAccount token for the audience \"credbroker\"; " +
		"used for this call and by the plugin on every call"
	cmd.Flags().StringVar(&o.cluster, "cluster", "", "ClusterProfile `<namespace>/<name>` (required)")
	cmd.Flags().StringVar(&o.serviceAccount, "service-account", "", "spoke ServiceAccount `<namespace>/<name>`; default: the single one that allows the caller")
	cmd.Flags().StringSliceVar(&o.audiences, "audience", nil, "audience of the spoke tokens; repeatable; default: the spoke API server's")
	cmd.Flags().Int64Var(&o.expirationSeconds, "expiration-seconds", 0, "requested token lifetime in seconds; 0 means the broker's maximum")
	cmd.Flags().StringVar(&o.pluginPath, "plugin-path", "credbroker-plugin", "the plugin the kubeconfig execs: a name looked up in PATH, or a path")
	cmd.Flags().StringVarP(&o.output, "output", "o", "", "write the kubeconfig to this file, mode 0600, instead of standard output")
	return cmd
}

// buildKubeconfig returns a kubeconfig with one cluster, user and context,
// all named after the ClusterProfile.
func buildKubeconfig(cfg kubeconfigConfig, server string, caData []byte) *clientcmdapi.Config {
	name := cfg.Cluster.Namespace + "/" + cfg.Cluster.Name
	kc := clientcmdapi.NewConfig()
	c := clientcmdapi.NewCluster()
	c.Server = server
	c.CertificateAuthorityData = caData
	kc.Clusters[name] = c
	u := clientcmdapi.NewAuthInfo()
	u.Exec = &clientcmdapi.ExecConfig{
		APIVersion:         "client.authentication.k8s.io/v1",
		Command:            cfg.PluginPath,
		Args:               cfg.PluginArgs,
		ProvideClusterInfo: true,
		InteractiveMode:    clientcmdapi.NeverExecInteractiveMode,
		InstallHint: "credbroker-plugin gets spoke tokens from the credbroker broker; build it with " +
			"go install github.com/credbroker/credbroker/cmd/credbroker-plugin@latest",
	}
	kc.AuthInfos[name] = u
	ctx := clientcmdapi.NewContext()
	ctx.Cluster, ctx.AuthInfo = name, name
	kc.Contexts[name] = ctx
	kc.CurrentContext = name
	return kc
}

func writeKubeconfig(s streams, cfg kubeconfigConfig, kc *clientcmdapi.Config) error {
	b, err := clientcmd.Write(*kc)
	if err != nil {
		return fmt.Errorf("encode kubeconfig: %w", err)
	}
	if cfg.Output == "" {
		_, err = s.out.Write(b)
		return err
	}
	f, err := os.OpenFile(cfg.Output, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("-o: %w", err)
	}
	// An existing file keeps its mode on open; a kubeconfig is for its owner.
	if err := f.Chmod(0o600); err != nil {
		_ = f.Close()
		return fmt.Errorf("-o: %w", err)
	}
	if _, err := f.Write(b); err != nil {
		_ = f.Close()
		return fmt.Errorf("-o: %w", err)
	}
	return f.Close()
}

// defaultTimeout is --timeout's default.
const defaultTimeout = 30 * time.Second
