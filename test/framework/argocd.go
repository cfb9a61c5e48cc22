package framework

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clientcmdlatest "k8s.io/client-go/tools/clientcmd/api/latest"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/yaml"
)

// ArgoCDClusterConfig mirrors the json tags of Argo CD's ClusterConfig
// (pkg/apis/application/v1alpha1, the "config" key of a cluster Secret),
// as of Argo CD v3.5.0, which added execProviderConfig.provideClusterInfo
// and execProviderConfig.config.
type ArgoCDClusterConfig struct {
	Username           string                    `json:"username,omitempty"`
	Password           string                    `json:"password,omitempty"`
	BearerToken        string                    `json:"bearerToken,omitempty"`
	TLSClientConfig    ArgoCDTLSClientConfig     `json:"tlsClientConfig"`
	AWSAuthConfig      *json.RawMessage          `json:"awsAuthConfig,omitempty"`
	ExecProviderConfig *ArgoCDExecProviderConfig `json:"execProviderConfig,omitempty"`
	DisableCompression bool                      `json:"disableCompression,omitempty"`
	ProxyURL           string                    `json:"proxyUrl,omitempty"`
}

// ArgoCDTLSClientConfig mirrors Argo CD's TLSClientConfig.
type ArgoCDTLSClientConfig struct {
	Insecure   bool   `json:"insecure"`
	ServerName string `json:"serverName,omitempty"`
	CertData   []byte `json:"certData,omitempty"`
	KeyData    []byte `json:"keyData,omitempty"`
	CAData     []byte `json:"caData,omitempty"`
}

// ArgoCDExecProviderConfig mirrors Argo CD's ExecProviderConfig.
type ArgoCDExecProviderConfig struct {
	Command     string            `json:"command,omitempty"`
	Args        []string          `json:"args,omitempty"`
	Env         map[string]string `json:"env,omitempty"`
	APIVersion  string            `json:"apiVersion,omitempty"`
	InstallHint string            `json:"installHint,omitempty"`
	// ProvideClusterInfo hands the plugin the cluster's server, CA and
	// Config in KUBERNETES_EXEC_INFO.
	ProvideClusterInfo bool `json:"provideClusterInfo,omitempty"`
	// Config becomes the cluster's client.authentication.k8s.io/exec
	// extension, and so the plugin's spec.cluster.config.
	Config *runtime.RawExtension `json:"config,omitempty"`
}

// ParseArgoCDClusterSecret reads an Argo CD cluster Secret manifest and its
// config strictly: a field that Argo CD does not know, which it would
// ignore, is an error.
func ParseArgoCDClusterSecret(manifest []byte) (*corev1.Secret, *ArgoCDClusterConfig, error) {
	var secret corev1.Secret
	if err := yaml.UnmarshalStrict(manifest, &secret); err != nil {
		return nil, nil, fmt.Errorf("framework: argocd cluster secret: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader([]byte(secret.StringData["config"])))
	dec.DisallowUnknownFields()
	var cfg ArgoCDClusterConfig
	if err := dec.Decode(&cfg); err != nil {
		return nil, nil, fmt.Errorf("framework: argocd cluster secret %s: config: %w", secret.Name, err)
	}
	return &secret, &cfg, nil
}

// RESTConfig is the client configuration that Argo CD's Cluster.RESTConfig
// builds for a cluster Secret with an exec provider and server: the
// server, its CA, and the ExecProvider, whose Config travels as the
// cluster's exec extension (converted as client-go converts a kubeconfig's,
// which is also how cluster-inventory-api's pkg/access carries it).
func (c *ArgoCDClusterConfig) RESTConfig(server string) (*rest.Config, error) {
	exec := c.ExecProviderConfig
	if exec == nil {
		return nil, fmt.Errorf("framework: argocd cluster config has no execProviderConfig")
	}
	cfg := &rest.Config{
		Host: server,
		TLSClientConfig: rest.TLSClientConfig{
			Insecure: c.TLSClientConfig.Insecure, ServerName: c.TLSClientConfig.ServerName, CAData: c.TLSClientConfig.CAData,
		},
		ExecProvider: &clientcmdapi.ExecConfig{
			Command: exec.Command, Args: exec.Args, APIVersion: exec.APIVersion, InstallHint: exec.InstallHint,
			ProvideClusterInfo: exec.ProvideClusterInfo, InteractiveMode: clientcmdapi.NeverExecInteractiveMode,
		},
	}
	for _, k := range slices.Sorted(maps.Keys(exec.Env)) {
		cfg.ExecProvider.Env = append(cfg.ExecProvider.Env, clientcmdapi.ExecEnvVar{Name: k, Value: exec.Env[k]})
	}
	if exec.Config != nil {
		cluster := clientcmdv1.Cluster{Server: server, Extensions: []clientcmdv1.NamedExtension{{Name: ExecExtensionName, Extension: *exec.Config}}}
		internal := clientcmdapi.NewCluster()
		if err := clientcmdlatest.Scheme.Convert(&cluster, internal, nil); err != nil {
			return nil, fmt.Errorf("framework: argocd exec config: %w", err)
		}
		cfg.ExecProvider.Config = internal.Extensions[ExecExtensionName]
	}
	return cfg, nil
}
